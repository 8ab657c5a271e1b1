"""One-time costs of a start, paid early in threads of the engine process instead of inside its first
kernel launch, each behind its own switch (off by default: neither made a start measurably faster on the
H200, BENCHMARKS.md, issue 16, h50).

Triton's installation key (PAGEDLLM_TRITON_KEY_PREFETCH=1). Before Triton looks a compiled variant up
in its disk cache, each process hashes Triton's own installation once (`triton_key()`, kept by an
lru_cache: every compiler, backend and language module and the whole libtriton shared library,
~500 MB; 0.35-0.7 s on a 2-core CPU with the file cached). A warm start paid it inside the memory
profile's first forward, a compile process inside its first compile. A daemon thread pays it while
the engine process imports, builds its config and loads the model (hashlib and file reads release
the GIL), and each compile process while it waits for its variants; the worker waits for the thread
before its first launch (`wait_for_triton_key`):

    engine process:  imports | CUDA init | config | model load | first Triton launch
    thread:          [ triton_key(): read + sha256 libtriton ]   -> found cached

The CUDA context (PAGEDLLM_CUDA_CONTEXT_PREFETCH=1). `torch.cuda.init()` creates no context; the
first call that needs one (the worker's free-memory check) does, and the first GEMM creates the
cuBLAS handles. A thread started right after CUDA's initialisation makes both while the main thread
builds the config and the model: the primary context is the process's, and a handle made by a
thread that has ended goes back to torch's pool for the next thread that asks (the main one).
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


def prefetch_cuda_context() -> threading.Thread | None:
    """With PAGEDLLM_CUDA_CONTEXT_PREFETCH=1 and CUDA initialised, start a daemon thread that creates the
    current device's context and cuBLAS / cuBLASLt handles (-> the thread); else None."""
    from pagedllm import envs

    if not envs.PAGEDLLM_CUDA_CONTEXT_PREFETCH:
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()

    def run() -> None:
        t0 = time.monotonic()
        try:
            torch.cuda.set_device(device)  # a new thread starts on device 0
            torch.cuda.mem_get_info(device)  # the primary context
            torch.cuda.current_blas_handle()
            a = torch.zeros((8, 8), device=f"cuda:{device}")
            torch.matmul(a, a)  # cuBLAS(Lt)'s own first-use work
            torch.cuda.synchronize(device)
        except Exception as e:  # noqa: BLE001 - the main thread meets and reports any CUDA problem
            logger.debug("CUDA context not made early (%s)", e)
            return
        logger.info("start-up: CUDA context and cuBLAS handle (in a thread) took %.2f s", time.monotonic() - t0)

    thread = threading.Thread(target=run, name="pagedllm-cuda-context", daemon=True)
    thread.start()
    return thread


_key_thread: threading.Thread | None = None  # prefetch_triton_key's, until wait_for_triton_key


def wait_for_triton_key(timeout: float = 30.0) -> None:
    """Before this process's first Triton launch: wait for the prefetch thread, if one runs. Triton's
    lru_cache does not make a second caller wait, so without this the first launch would hash the
    installation again beside the thread (round 1 of h50 on the H200: 0.2 s of the main thread's time
    in sha256 while the thread was still at it)."""
    global _key_thread
    thread, _key_thread = _key_thread, None
    if thread is not None:
        thread.join(timeout)


def prefetch_triton_key() -> threading.Thread | None:
    """With PAGEDLLM_TRITON_KEY_PREFETCH=1, start a daemon thread computing the key (-> the thread);
    else None. Only in a process that forks nothing afterwards (the engine process, after its compile
    processes were forked)."""
    global _key_thread
    from pagedllm import envs

    if not envs.PAGEDLLM_TRITON_KEY_PREFETCH:
        return None

    def run() -> None:
        seconds = compute_triton_key()
        if seconds:
            logger.info("start-up: Triton's installation key (in a thread) took %.2f s", seconds)

    thread = threading.Thread(target=run, name="pagedllm-triton-key", daemon=True)
    thread.start()
    _key_thread = thread
    return thread
