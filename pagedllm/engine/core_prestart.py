"""The engine process started before the frontend's config exists (`pagedllm serve` on one CUDA device).

    frontend                                            prestarted engine process
    --------                                            -------------------------
    prestart_engine_process(engine_args)  ---------->   imports, CUDA init, its own config, the model
    builds its config, tokenizer, app
    EngineCoreProc.start(config): takes it  -------->   the frontend's config (rebuilt if it differs)
      when `env_fits` (else ends it, starts another)

BENCHMARKS.md, issue 16 (h29, h47) measured the overlap. The process itself is an EngineCoreProc
(engine/core_proc.py) built without a config.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import TYPE_CHECKING, Any

import pagedllm.envs as envs
from pagedllm.engine import fork_server

if TYPE_CHECKING:
    from pagedllm.engine.core_proc import EngineCoreProc

logger = logging.getLogger(__name__)

# The engine process started by `prestart_engine_process` (a future: it starts in a thread), until
# EngineCoreProc.start takes it.
_prestarted: concurrent.futures.Future[EngineCoreProc] | None = None


def prestart_engine_process(engine_args: Any, warm_cuda: bool) -> bool:
    """Start the engine process now, before the frontend has built the config from `engine_args`
    (the server calls this just before): its imports, with `warm_cuda` (one CUDA device will run
    the model) CUDA's initialisation, its own config and the model load overlap the frontend's
    config, tokenizer and app instead of following them (`_await_config`). `EngineCoreProc.start`
    hands it the frontend's config, or starts a new process when this one does not fit (the
    environment changed since, or the config is not for one CUDA device). -> whether one was started."""
    global _prestarted
    if _prestarted is None and fork_server.available():
        # In a thread: starting a process waits until the fork server has finished its own imports.
        _prestarted = concurrent.futures.Future()
        threading.Thread(target=_start_into, args=(_prestarted, engine_args, warm_cuda),
                         name="pagedllm-engine-prestart", daemon=True).start()
    return _prestarted is not None


def prestart_for_server(engine_args: Any) -> None:
    """`pagedllm serve`'s use of the prestart: only with PAGEDLLM_PRESTART_ENGINE=1, an engine process
    (not a thread) and one CUDA device. On the CPU the engine's work competes with the frontend's for the
    same few cores (a 2-core machine measured no gain), and a multi-GPU engine starts its own workers:
    both keep the old order."""
    if envs.PAGEDLLM_ENABLE_MULTIPROCESSING is False or not envs.PAGEDLLM_PRESTART_ENGINE:
        return
    ea = engine_args
    one_device = ea.tensor_parallel_size * ea.pipeline_parallel_size == 1 and ea.distributed_executor_backend is None
    if ea.device not in ("auto", "cuda") or not one_device:
        return
    import torch

    if torch.cuda.is_available() and prestart_engine_process(ea, warm_cuda=True):
        from pagedllm.worker.compile_pool import leave_to_engine_process

        leave_to_engine_process()  # PAGEDLLM_PARALLEL_COMPILE=1: the engine process starts its own


def _start_into(future: concurrent.futures.Future[EngineCoreProc], engine_args: Any, warm_cuda: bool) -> None:
    from pagedllm.engine.core_proc import EngineCoreProc  # here: core_proc imports this module

    try:
        future.set_result(EngineCoreProc(None, None, warm_cuda=warm_cuda, engine_args=engine_args))
    except BaseException as e:  # noqa: BLE001 - then EngineCoreProc.start starts one itself
        future.set_exception(e)


def take_prestarted() -> EngineCoreProc | None:
    """The prestarted engine process (waits for its start), or None; it is the caller's from now on."""
    from pagedllm.engine.core_proc import STARTUP_TIMEOUT_S

    global _prestarted
    future, _prestarted = _prestarted, None
    if future is None:
        return None
    try:
        return future.result(STARTUP_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001
        logger.info("the early engine process did not start (%s); starting one now", e)
        return None


def discard_prestarted_engine_process() -> None:
    """The frontend stops before it started its engine (a bad flag): end the early process."""
    early = take_prestarted()
    if early is not None:
        early.close(5.0)


# Variables read when torch, Triton or CUDA start (or by pagedllm, envs.py): a prestarted engine
# process has read them, so one that differs now makes the frontend start a new process.
# Only pagedllm's and the device stack's own switches: a program (or a test) that sets one after the
# process started means it. Libraries' import side effects are not among them (below).
_READ_AT_START = ("PAGEDLLM_", "TRITON_", "CUDA_", "PYTORCH_", "NCCL_", "NVIDIA_", "LD_")


def env_fits(then: dict[str, str], now: dict[str, str]) -> bool:
    """Whether a process started with environment `then` can serve a frontend whose environment is
    `now`: equal, but for variables added since that are not the engine's switches. The frontend's
    own imports add some while it builds its config, and the engine process meets the same imports
    building its own: on the H200 host scikit-learn (through transformers' generation utilities) set
    KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK, and torch's inductor TORCHINDUCTOR_CACHE_DIR, which
    made the process unfit (BENCHMARKS.md, issue 16, h47)."""
    if any(now.get(k) != v for k, v in then.items()):
        return False
    return not any(k.startswith(_READ_AT_START) for k in now.keys() - then.keys())
