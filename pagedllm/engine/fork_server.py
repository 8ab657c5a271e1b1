"""The fork server the engine process starts from (engine/core_proc.py), and its earliest start.

The engine process is forked from a fork server that has imported torch and transformers, so each
engine starts from a clean single-threaded process without paying those imports again (spawn would;
fork would copy the frontend's threads). The fork server is a fresh Python that imports them itself,
seconds on any machine: `pagedllm serve` starts it first thing (entrypoints/cli.py), before its own
imports, so those seconds pass while the frontend imports and reads the config. Otherwise it starts
with the first engine process.

This module imports nothing of torch or pagedllm: the command line calls it before those load.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver

# Imported once by the fork server. Of pagedllm only a module that reads no environment variable:
# its other modules may read the environment at import, and a fork server lives as long as its
# process (a test that sets a variable later must not get modules that read the old one). The
# transformers modules are the ones every engine process imports, without transformers' generated
# docstrings (loader/preload_transformers.py: their generator imports the auto-model registry; why
# not the config classes' heavier imports is said there). A module a transformers version lacks is
# skipped.
PRELOAD = ["torch", "pagedllm.loader.preload_transformers"]


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the fork server now (its imports run in its own process while this one goes on); the
    first engine process started later forks from it. Nothing happens where there is no fork server."""
    if available():
        context()
        multiprocessing.forkserver.ensure_running()
