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

import logging
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection

from pagedllm.config import EngineConfig
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

logger = logging.getLogger(__name__)

# Imported once by the fork server (nothing of pagedllm: its modules read the environment, which the
# engine process takes from the frontend as it is when the engine starts).
PRELOAD = ["torch", "transformers"]
# Seconds the frontend waits for the engine process to load the model and report ready.
STARTUP_TIMEOUT_S = 600.0


def _engine_main(config: EngineConfig, inputs: Connection, outputs: Connection, env: dict[str, str],
                 log_level: int, log_format: str | None, fail_at_step: int | None) -> None:
    """The engine process: build the EngineCore, then serve commands and step until told to stop."""
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
    t0 = time.monotonic()
    from pagedllm.engine.core_loop import EngineCoreLoop
    from pagedllm.engine.engine_core import EngineCore

    # The start-up timeline (scripts/gpu_cold_start.py): when the engine process began its own work.
    logger.info("start-up: engine process imports took %.2f s", time.monotonic() - t0)

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
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the frontend, which raises it
        emit(StartupFailed(ErrorInfo.from_exception(e)))
        return
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


def _context() -> multiprocessing.context.BaseContext:
    # A fork server that has imported torch: each engine starts from a clean single-threaded process
    # without paying torch's import again (spawn would, ~2 s; fork would copy the frontend's threads).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def multiprocessing_available() -> bool:
    return "forkserver" in multiprocessing.get_all_start_methods()


class EngineCoreProc:
    """The frontend's handle on the engine process: start it, wait until it is ready (the model loads
    there; its errors are raised here), send commands, receive messages, stop it."""

    def __init__(self, config: EngineConfig, fail_at_step: int | None) -> None:
        ctx = _context()
        self._inputs_recv, self._inputs = ctx.Pipe(duplex=False)
        self._outputs, self._outputs_send = ctx.Pipe(duplex=False)
        root = logging.getLogger()
        fmt = root.handlers[0].formatter._fmt if root.handlers and root.handlers[0].formatter else None
        self.process = ctx.Process(
            target=_engine_main, name="pagedllm-engine-core", daemon=True,
            args=(config, self._inputs_recv, self._outputs_send, dict(os.environ), root.level, fmt, fail_at_step),
        )
        self.process.start()
        # The child holds its own ends now; closing ours lets each side see EOF when the other dies.
        self._inputs_recv.close()
        self._outputs_send.close()
        self.num_gpu_blocks: int | None = None

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
        """The next message; EOFError when the engine process is gone."""
        return reply_decoder.decode(self._outputs.recv_bytes())

    def close(self, timeout: float = 5.0) -> None:
        """Ask the process to stop (it finishes its step), then make sure it has."""
        try:
            self.send(Shutdown())
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
            conn.close()
