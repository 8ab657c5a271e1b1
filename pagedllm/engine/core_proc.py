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

The engine process's own code is engine/core_proc_main.py (`run_engine_core`). Started before the
frontend's config exists (`pagedllm serve` on one CUDA device), the prestart at the end of this module:

    frontend                                            prestarted engine process
    --------                                            -------------------------
    prestart_engine_process(engine_args)  ---------->   imports, CUDA init, its own config, the model
    builds its config, tokenizer, app
    EngineCoreProc.start(config): takes it  -------->   the frontend's config (rebuilt if it differs)
      when `env_fits` (else ends it, starts another)

BENCHMARKS.md, issue 16 (h29, h47) measured the overlap.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import os
import pickle
import threading
from typing import Any

import pagedllm.envs as envs
from pagedllm.config import EngineConfig
from pagedllm.engine import fork_server
from pagedllm.engine.core_proc_main import load_config as _load_config  # noqa: F401 - the same
from pagedllm.engine.core_proc_main import run_engine_core
from pagedllm.engine.messages import (
    EngineCoreCommand,
    EngineCoreReply,
    Ready,
    Shutdown,
    StartupFailed,
    encode,
    reply_decoder,
)
from pagedllm.engine.pipe_frames import FrameReader

logger = logging.getLogger(__name__)

# Seconds the frontend waits for the engine process to load the model and report ready.
STARTUP_TIMEOUT_S = 600.0


def _context() -> multiprocessing.context.BaseContext:
    return fork_server.context()  # the engine process forks from a fork server (engine/fork_server.py)


def multiprocessing_available() -> bool:
    return fork_server.available()


class EngineCoreProc:
    """The frontend's handle on the engine process: start it, wait until it is ready (the model loads
    there; its errors are raised here), send commands, receive messages, stop it."""

    @classmethod
    def start(cls, config: EngineConfig, fail_at_step: int | None) -> EngineCoreProc:
        """The engine process for `config`: the prestarted one when it fits, else a new one."""
        early = take_prestarted()
        if early is not None:
            one_cuda_device = config.device_config.device == "cuda" and config.parallel_config.world_size == 1
            now = dict(os.environ)
            if env_fits(early.env, now) and early.warm_cuda == one_cuda_device and early.process.is_alive():
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
            target=run_engine_core, name="pagedllm-engine-core", daemon=True,
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
        self.send_frame(encode(command))

    def send_frame(self, frame: bytes) -> None:
        """One encoded command (`encode`); OSError when the engine process is gone."""
        self._inputs.send_bytes(frame)

    def recv(self) -> EngineCoreReply:
        """The next message; EOFError when the engine process is gone. Not after recv_many."""
        return reply_decoder.decode(self._outputs.recv_bytes())

    def recv_many(self) -> list[EngineCoreReply]:
        """Every message that has arrived, in order, at least one (one read for all of them:
        engine/pipe_frames.py); EOFError when the engine process is gone. The receiver thread's, after
        wait_ready (recv and this one must not be mixed: this one reads ahead)."""
        return [reply_decoder.decode(frame) for frame in self.recv_frames()]

    def recv_frames(self) -> list[bytes]:
        """recv_many's frames, not decoded yet (the receiver decodes each on its own: a frame that
        does not decode costs its requests, not the others)."""
        if self._frames is None:
            self._frames = FrameReader(self._outputs.fileno())
        return self._frames.read_frames()

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
    try:
        future.set_result(EngineCoreProc(None, None, warm_cuda=warm_cuda, engine_args=engine_args))
    except BaseException as e:  # noqa: BLE001 - then EngineCoreProc.start starts one itself
        future.set_exception(e)


def take_prestarted() -> EngineCoreProc | None:
    """The prestarted engine process (waits for its start), or None; it is the caller's from now on."""
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
