"""Triton's once-per-process cache-key work, done early in a thread (the engine process) or while idle
(a compile process), instead of inside the start's first kernel launch.

Before Triton looks a compiled variant up in its disk cache, each process hashes Triton's own
installation once (`triton_key()`, kept by an lru_cache: every compiler, backend and language module
and the whole libtriton shared library, ~500 MB; 0.35 s on a 2-core CPU with the file cached). A warm
start paid it inside the memory profile's first forward, a compile process inside its first compile.
Here a daemon thread pays it while the engine process imports, builds its config and loads the
model: hashlib and file reads release the GIL, so it overlaps that work. PAGEDLLM_TRITON_KEY_PREFETCH=1
turns it on (off until an H200 start measured it).

    engine process:  imports | CUDA init | config | model load | profile's forward (first launch)
    thread:                  [ triton_key(): read + sha256 libtriton ]           -> found in the cache
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def _triton_key() -> Callable[[], str]:
    """Triton's own cached function (triton.runtime.cache from Triton 3.4, triton.compiler before)."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        from triton.compiler.compiler import triton_key
    return triton_key


def compute_triton_key() -> float:
    """Fill Triton's cached installation key now; -> seconds it took (0.0 where Triton has no such key)."""
    t0 = time.monotonic()
    try:
        _triton_key()()
    except Exception as e:  # noqa: BLE001 - another Triton: its first launch computes what it needs
        logger.debug("Triton installation key not computed early (%s)", e)
        return 0.0
    return time.monotonic() - t0


def prefetch_triton_key() -> threading.Thread | None:
    """With PAGEDLLM_TRITON_KEY_PREFETCH=1, start a daemon thread computing the key (-> the thread);
    else None. Only in a process that forks nothing afterwards (the engine process, after its compile
    processes were forked)."""
    from pagedllm import envs

    if not envs.PAGEDLLM_TRITON_KEY_PREFETCH:
        return None

    def run() -> None:
        seconds = compute_triton_key()
        if seconds:
            logger.info("start-up: Triton's installation key (in a thread) took %.2f s", seconds)

    thread = threading.Thread(target=run, name="pagedllm-triton-key", daemon=True)
    thread.start()
    return thread
