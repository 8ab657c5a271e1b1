"""The engine process's side of engine/core_proc.py: its entry point, `run_engine_core`, and its start.

    EngineCoreProc (the frontend)         run_engine_core (this process)
    -----------------------------         ------------------------------
    config (pickled, once)          ----> load_config / _await_config: the EngineConfig
                                          EngineCore(config): the model loads
    wait_ready                      <---- Ready | StartupFailed
    send(command) ... recv_many     <---> EngineCoreLoop (engine/core_loop.py) until Shutdown

Started by `EngineCoreProc` (with the config) or by the prestart (engine/core_proc.py: without one;
it builds its own from the frontend's EngineArgs while the frontend builds the same). The loop reads
and writes the pipes through engine/core_proc_wire.py, where a message that cannot be decoded or
encoded fails its requests and the loop goes on.
"""

from __future__ import annotations

import gc
import io
import logging
import os
import pickle
import signal
import time
from multiprocessing.connection import Connection
from typing import Any

import pagedllm.envs as envs
from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc_wire import CommandReader, ReplyWriter
from pagedllm.engine.messages import EngineDead, ErrorInfo, Ready, StartupFailed

logger = logging.getLogger(__name__)


def run_engine_core(config_blob: bytes | None, inputs: Connection, outputs: Connection, env: dict[str, str],
                 log_level: int, log_format: str | None, fail_at_step: int | None, warm_cuda: bool = False,
                 engine_args: Any = None) -> None:
    """The engine process: build the EngineCore, then serve commands and step until told to stop.
    config_blob: the pickled EngineConfig, unpickled here (`load_config`). Started early
    (`prestart_engine_process`: no config yet), it first imports and, with `warm_cuda`, initialises
    CUDA, then builds its EngineCore from the frontend's `engine_args` while the frontend builds the
    same config (`_await_config`)."""
    # What the fork server imported (torch: about a third of the objects at ready) lives as long
    # as this process: out of the collector's sight now, so the full pass of freeze_gc_heap at
    # engine start walks only what this process makes (2-core CPU, tiny model: 0.23 -> 0.08 s).
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):  # a terminal hang-up reaches the whole group; the frontend handles it
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # The frontend's environment as it is now (a forked child has the fork server's), before any
    # pagedllm module reads it.
    os.environ.clear()
    os.environ.update(env)
    if log_format is not None:
        logging.basicConfig(level=log_level, format=log_format)
    logger.info("start-up: engine process started")  # forked once the fork server had its imports
    t0 = time.monotonic()
    profile = _startup_profile()
    if warm_cuda:
        # First, while this process has no thread and no CUDA context: on a fresh machine (unless
        # PAGEDLLM_PARALLEL_COMPILE=0), the Triton compile processes forked from it (torch imported).
        from pagedllm.worker.compile_pool import fork_compile_pool

        fork_compile_pool(close_in_child=(inputs.fileno(), outputs.fileno()))
    from pagedllm.engine.core_loop import EngineCoreLoop
    from pagedllm.engine.engine_core import EngineCore

    if warm_cuda:  # what the worker would do first, done while the frontend still builds the config
        try:
            import torch

            import pagedllm.attention.triton_backend  # noqa: F401 - the GPU path's kernels and Triton

            t1 = time.monotonic()
            torch.cuda.init()
            logger.info("start-up: engine process imports took %.2f s, then CUDA init %.2f s", t1 - t0,
                        time.monotonic() - t1)
        except Exception as e:  # noqa: BLE001 - the worker does it again and reports what fails
            logger.warning("engine process: early CUDA initialisation failed (%s)", e)
    else:
        # The start-up timeline (scripts/gpu_cold_start.py): when the engine process began its own work.
        logger.info("start-up: engine process imports took %.2f s", time.monotonic() - t0)
    core: EngineCore | None = None
    early_error: BaseException | None = None
    config = load_config(config_blob) if config_blob is not None else None
    if config is None:
        try:
            config, core, early_error, fail_at_step = _await_config(inputs, engine_args)
        except EOFError:
            return  # the frontend did not need this process (a bad flag, a busy port)

    emit = ReplyWriter(outputs)
    next_commands = CommandReader(inputs, emit)  # both answer a bad message and go on (core_proc_wire.py)

    try:
        if early_error is not None:
            raise early_error
        if core is None:
            core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the frontend, which raises it
        emit(StartupFailed(ErrorInfo.from_exception(e)))
        return
    # The start completed (a prestarted process's own config agreed with the frontend's, which was
    # built before this): the next start reads the model config back (loader/hf_configs.py). Not
    # before: a frontend still building its config would read a snapshot this process's differs from.
    from pagedllm.loader import hf_configs

    hf_configs.remember()
    if profile is not None:
        _log_profile(*profile)
    emit(Ready(core.num_gpu_blocks))
    try:
        EngineCoreLoop(core, emit, fail_at_step).run(next_commands)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the frontend is gone
    except BaseException as e:  # noqa: BLE001 - the frontend turns this into EngineDeadError
        logger.exception("engine process died")
        try:
            emit(EngineDead(ErrorInfo.from_exception(e)))
        except OSError:
            pass
    finally:
        core.shutdown()


def _startup_profile() -> tuple[Any, int] | None:
    """(a running cProfile.Profile, lines to log) with PAGEDLLM_STARTUP_PROFILE=N, else None."""
    lines = envs.PAGEDLLM_STARTUP_PROFILE
    if not lines:
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile, lines


def _log_profile(profile: Any, lines: int) -> None:
    """The engine start's profile: its `lines` functions of most cumulative time, then of most own time."""
    import pstats

    profile.disable()
    for order in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(lines)
        body = out.getvalue()
        body = body[body.find("ncalls"):] if "ncalls" in body else body
        logger.info("start-up profile of the engine process, by %s time:\n%s", order, body.rstrip())


class _ConfigUnpickler(pickle.Unpickler):
    """Imports a transformers class (a model config built by transformers) without generated
    docstrings, so without transformers' auto-model modules (loader/hf_configs.py: seconds); imports
    nothing of transformers for a config that holds none (a kept ConfigSnapshot: on the H200 host the
    patch's own `import transformers` was the 1.5 s between a warm engine's ready and its Ready)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "transformers" or module.startswith("transformers."):
            from pagedllm.loader.hf_configs import without_generated_docstrings

            with without_generated_docstrings():
                return super().find_class(module, name)
        return super().find_class(module, name)


def load_config(blob: bytes) -> EngineConfig:
    """The frontend's pickled EngineConfig, unpickled here (not by multiprocessing before this
    process's code runs) by `_ConfigUnpickler`."""
    return _ConfigUnpickler(io.BytesIO(blob)).load()


def _await_config(inputs: Connection, engine_args: Any) -> tuple[EngineConfig, Any, BaseException | None, int | None]:
    """A prestarted engine process's config and core: (config, EngineCore or None, its start-up
    error, fail_at_step).

    The frontend builds the config from `engine_args` and sends it (one pickled frame) once built;
    this process builds the same config itself meanwhile (faster: its fork server has imported the
    transformers modules a config needs) and its EngineCore with it, so the model loads while the
    frontend still reads the config. The frontend's config is the one served: when it is not equal
    to this one (it never should be: both are built from the same arguments and environment), the
    core is built again from it. A config error is the frontend's to report: this process then
    waits for the config (EOFError: the frontend stopped instead)."""
    from pagedllm.engine.engine_core import EngineCore

    own = core = error = None
    if engine_args is not None:
        t0 = time.monotonic()
        try:
            own = engine_args.create_engine_config()
            logger.info("start-up: the engine process's own config took %.2f s", time.monotonic() - t0)
        except Exception:  # noqa: BLE001 - the frontend's create_engine_config raises it to the user
            own = None
    if own is not None:
        try:
            core = EngineCore(own)
        except BaseException as e:  # noqa: BLE001 - reported once the frontend's config agrees
            error = e
    config_blob, fail_at_step, env = pickle.loads(inputs.recv_bytes())
    config = load_config(config_blob)
    os.environ.clear()  # the frontend's environment now (_env_fits: only variables nothing read yet differ)
    os.environ.update(env)
    if own is not None and config != own:
        logger.warning("the engine process's config differs from the frontend's; building the engine again")
        if core is not None:
            core.shutdown()
        core = error = None
    return config, core, error, fail_at_step
