"""The fork server the engine process starts from (engine/core_proc.py), and its earliest start.

The engine process is forked from a fork server that has imported torch, so each engine starts from
a clean single-threaded process without paying that import again (spawn would; fork would copy the
frontend's threads). The fork server is a fresh Python that imports it itself, seconds on any
machine: `pagedllm serve` starts it first thing (entrypoints/cli.py), before its own
imports, so those seconds pass while the frontend imports and reads the config. Otherwise it starts
with the first engine process.

This module imports nothing of torch or pagedllm: the command line calls it before those load.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver

# Imported once by the fork server. Nothing of pagedllm: its modules may read the environment at
# import, and a fork server lives as long as its process (a test that sets a variable later must not
# get modules that read the old one). Not transformers either: an engine process whose model config
# was kept from an earlier start imports none of it (loader/hf_configs.py: ConfigSnapshot), and on
# the H200 host the package and a config class's imports cost ~7 s more before the engine process
# could start; a first start imports them after the fork, as serially as here.
PRELOAD = ["torch"]


def preload_modules() -> list[str]:
    """PRELOAD, after pagedllm's byte-code cache with PAGEDLLM_BYTECODE_CACHE=1 (pagedllm/_bytecode_preload.py
    installs pagedllm/bytecode_cache.py's finder, so the engine processes forked from the fork server import
    through it; it reads that switch and the cache root once, at the fork server's start)."""
    from pagedllm import envs  # reads nothing at import

    return (["pagedllm._bytecode_preload"] if envs.PAGEDLLM_BYTECODE_CACHE else []) + PRELOAD


def available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


def context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules())
    return ctx


def start_early() -> None:
    """Start the fork server now (its imports run in its own process while this one goes on); the
    first engine process started later forks from it. Nothing happens where there is no fork server."""
    if available():
        context()
        multiprocessing.forkserver.ensure_running()
