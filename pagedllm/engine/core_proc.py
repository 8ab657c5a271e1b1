"""EngineCore in its own process (vLLM's EngineCoreProc), for AsyncLLM: the default on every device.

Why: in one process the server's event loop shares the GIL with the step loop. On
a CPU the step loop gives the GIL up at every kernel call (~250 per decode step) and needs it back
right after; whenever a frontend thread holds it then, both kernel workers wait (a frontend thread
costs the step loop several times more in the same process than in another one: BENCHMARKS.md,
"Measurements behind code decisions"). On a GPU it gives it up at every launch and sync, and the
server lost half its speed to that (BENCHMARKS.md, issue 16). Here the step loop has a GIL of its own.

    frontend process (AsyncLLM)                        engine process (this module's main)
    ---------------------------                        -----------------------------------
    sender thread:   AddRequests | AbortRequests | ... -> EngineCoreLoop (engine/core_loop.py):
                                                        apply the queued commands, step() while
                                                        requests run
    receiver thread: Ready | StartupFailed             <- once, at start
                     StepOutputs                       <- one per step
                     RequestsFailed | PrefixCacheReset <- as they happen
                     EngineDead                        <- a step raised: the engine is gone

The messages (engine/messages.py) travel as msgpack frames over two one-way pipes, never as pickle.
(Only the process's start arguments, the frozen EngineConfig, are pickled by multiprocessing, once.)
The engine process ignores SIGINT / SIGTERM / SIGHUP (the frontend drains or stops, then tells it
to stop) and exits when its input pipe closes (frontend gone).
"""

from __future__ import annotations

import concurrent.futures
import gc
import io
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import pagedllm.envs as envs
from pagedllm.config import EngineConfig
from pagedllm.engine import fork_server
from pagedllm.engine.messages import (
    EngineCoreCommand,
    EngineCoreReply,
    EngineDead,
    ErrorInfo,
    Ready,
    Shutdown,
    StartupFailed,
    command_decoder,
    encode,
    reply_decoder,
)
from pagedllm.engine.pipe_frames import FrameReader

logger = logging.getLogger(__name__)

# Seconds the frontend waits for the engine process to load the model and report ready.
STARTUP_TIMEOUT_S = 600.0


def _engine_main(config_blob: bytes | None, inputs: Connection, outputs: Connection, env: dict[str, str],
                 log_level: int, log_format: str | None, fail_at_step: int | None, warm_cuda: bool = False,
                 engine_args: Any = None) -> None:
    """The engine process: build the EngineCore, then serve commands and step until told to stop.
    config_blob: the pickled EngineConfig, unpickled here (`_load_config`). Started early
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
    config = _load_config(config_blob) if config_blob is not None else None
    if config is None:
        try:
            config, core, early_error, fail_at_step = _await_config(inputs, engine_args)
        except EOFError:
            return  # the frontend did not need this process (a bad flag, a busy port)

    def emit(reply: EngineCoreReply) -> bool:
        outputs.send_bytes(encode(reply))
        return True

    def next_commands(block: bool) -> list[EngineCoreCommand]:
        # Wait for one while idle, else take what is queued and go on stepping.
        if not block and not inputs.poll(0):
            return []
        batch = [command_decoder.decode(inputs.recv_bytes())]
        while inputs.poll(0):
            batch.append(command_decoder.decode(inputs.recv_bytes()))
        return batch

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


def _load_config(blob: bytes) -> EngineConfig:
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
    config = _load_config(config_blob)
    os.environ.clear()  # the frontend's environment now (_env_fits: only variables nothing read yet differ)
    os.environ.update(env)
    if own is not None and config != own:
        logger.warning("the engine process's config differs from the frontend's; building the engine again")
        if core is not None:
            core.shutdown()
        core = error = None
    return config, core, error, fail_at_step


def _context() -> multiprocessing.context.BaseContext:
    return fork_server.context()  # the engine process forks from a fork server (engine/fork_server.py)


def multiprocessing_available() -> bool:
    return fork_server.available()


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
    if _prestarted is None and multiprocessing_available():
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
    try:
        future.set_result(EngineCoreProc(None, None, warm_cuda=warm_cuda, engine_args=engine_args))
    except BaseException as e:  # noqa: BLE001 - then EngineCoreProc.start starts one itself
        future.set_exception(e)


def _take_prestarted() -> EngineCoreProc | None:
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
    early = _take_prestarted()
    if early is not None:
        early.close(5.0)


# Variables read when torch, Triton or CUDA start (or by pagedllm, envs.py): a prestarted engine
# process has read them, so one that differs now makes the frontend start a new process.
# Only pagedllm's and the device stack's own switches: a program (or a test) that sets one after the
# process started means it. Libraries' import side effects are not among them (below).
_READ_AT_START = ("PAGEDLLM_", "TRITON_", "CUDA_", "PYTORCH_", "NCCL_", "NVIDIA_", "LD_")


def _env_fits(then: dict[str, str], now: dict[str, str]) -> bool:
    """Whether a process started with environment `then` can serve a frontend whose environment is
    `now`: equal, but for variables added since that are not the engine's switches. The frontend's
    own imports add some while it builds its config, and the engine process meets the same imports
    building its own: on the H200 host scikit-learn (through transformers' generation utilities) set
    KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK, and torch's inductor TORCHINDUCTOR_CACHE_DIR, which
    made the process unfit (BENCHMARKS.md, issue 16, h47)."""
    if any(now.get(k) != v for k, v in then.items()):
        return False
    return not any(k.startswith(_READ_AT_START) for k in now.keys() - then.keys())


class EngineCoreProc:
    """The frontend's handle on the engine process: start it, wait until it is ready (the model loads
    there; its errors are raised here), send commands, receive messages, stop it."""

    @classmethod
    def start(cls, config: EngineConfig, fail_at_step: int | None) -> EngineCoreProc:
        """The engine process for `config`: the prestarted one when it fits, else a new one."""
        early = _take_prestarted()
        if early is not None:
            one_cuda_device = config.device_config.device == "cuda" and config.parallel_config.world_size == 1
            now = dict(os.environ)
            if _env_fits(early.env, now) and early.warm_cuda == one_cuda_device and early.process.is_alive():
                early._inputs.send_bytes(pickle.dumps((pickle.dumps(config), fail_at_step, now)))
                early._configured = True
                return early
            changed = sorted(k for k in early.env.keys() | now.keys() if early.env.get(k) != now.get(k))
            logger.info("the prestarted engine process does not fit (environment changed: %s; CUDA %s -> %s); "
                        "starting another", ", ".join(changed) or "no", early.warm_cuda, one_cuda_device)
            early.close(5.0)
        return cls(config, fail_at_step)

    def __init__(self, config: EngineConfig | None, fail_at_step: int | None, warm_cuda: bool = False,
                 engine_args: Any = None) -> None:
        ctx = _context()
        self._inputs_recv, self._inputs = ctx.Pipe(duplex=False)
        self._outputs, self._outputs_send = ctx.Pipe(duplex=False)
        root = logging.getLogger()
        fmt = root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter else None
        self.env = dict(os.environ)  # what the process's modules read at import
        self.warm_cuda = warm_cuda
        self._configured = config is not None
        self.process = ctx.Process(
            target=_engine_main, name="pagedllm-engine-core", daemon=True,
            args=(None if config is None else pickle.dumps(config), self._inputs_recv, self._outputs_send, self.env,
                  root.level, fmt, fail_at_step, warm_cuda,
                  engine_args),
        )
        self.process.start()
        # The child holds its own ends now; closing ours lets each side see EOF when the other dies.
        self._inputs_recv.close()
        self._outputs_send.close()
        self.num_gpu_blocks: int | None = None
        self._frames: FrameReader | None = None  # recv_many's, from the first call on

    def wait_ready(self) -> None:
        """Block until the engine process has loaded the model; raises what its EngineCore raised."""
        if not self._outputs.poll(STARTUP_TIMEOUT_S):
            self.close(0)
            raise RuntimeError(f"the engine process did not start within {STARTUP_TIMEOUT_S:.0f} s")
        try:
            reply = self.recv()
        except EOFError:
            self.close(0)
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        match reply:
            case Ready(num_gpu_blocks=n):
                self.num_gpu_blocks = n
            case StartupFailed(error=error):
                self.close(5)
                raise error.to_exception()
            case _:
                raise AssertionError(f"unexpected first message from the engine process: {reply!r}")

    def send(self, command: EngineCoreCommand) -> None:
        self._inputs.send_bytes(encode(command))

    def recv(self) -> EngineCoreReply:
        """The next message; EOFError when the engine process is gone. Not after recv_many."""
        return reply_decoder.decode(self._outputs.recv_bytes())

    def recv_many(self) -> list[EngineCoreReply]:
        """Every message that has arrived, in order, at least one (one read for all of them:
        engine/pipe_frames.py); EOFError when the engine process is gone. The receiver thread's, after
        wait_ready (recv and this one must not be mixed: this one reads ahead)."""
        if self._frames is None:
            self._frames = FrameReader(self._outputs.fileno())
        return [reply_decoder.decode(frame) for frame in self._frames.read_frames()]

    def close(self, timeout: float = 5.0) -> None:
        """Ask the process to stop (it finishes its step), then make sure it has."""
        try:
            if self._configured:
                self.send(Shutdown())
            else:  # a prestarted process nobody needs: it may be loading a model; nothing to finish
                self._inputs.close()
                self.process.kill()
        except OSError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(1.0)
        for conn in (self._inputs, self._outputs):
            if not conn.closed:
                conn.close()
