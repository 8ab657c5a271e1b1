"""EngineCore in its own process (vLLM's EngineCoreProc), for AsyncLLM on the CPU.

Why: in one process the server's event loop and output thread share the GIL with the step loop. On
a CPU the step loop gives the GIL up at every kernel call (~250 per decode step) and needs it back
right after; whenever a frontend thread holds it then, both kernel workers wait. Measured on 2 cores
at 16 streams: a thread holding the GIL 5% of the time made a decode step ~2.7 ms (8%) longer, the
same work in another process ~0.9 ms. Here the step loop has a GIL of its own.

    frontend process (AsyncLLM)                          engine process (this module's main)
    ---------------------------                          -----------------------------------
    sender thread:   ("add" | "abort" | "stop" | ...)  -> apply every queued command,
                                                          step() while requests run
    receiver thread: ("outputs", outputs, stats, ...)  <- one message per step
                     ("failed", [(id, error)])         <- requests the core refused
                     ("dead", error)                   <- a step raised: the engine is gone

Messages are pickled over two one-way pipes. The engine process ignores SIGINT / SIGTERM / SIGHUP
(the frontend drains or stops, then tells it to stop) and exits when its input pipe closes (frontend gone).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

# Imported once by the fork server (nothing of pagedllm: its modules read the environment, which the
# engine process takes from the frontend as it is when the engine starts).
PRELOAD = ["torch", "transformers"]
# Seconds the frontend waits for the engine process to load the model and report ready.
STARTUP_TIMEOUT_S = 600.0


def _picklable(e: BaseException) -> BaseException:
    """The exception itself when it crosses a pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(e).__name__}: {e}")


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
    from pagedllm.engine.engine_core import EngineCore, apply_command, check_injected_fault, step_and_queue_times

    try:
        core = EngineCore(config)
    except BaseException as e:  # noqa: BLE001 - reported to the frontend, which raises it
        outputs.send(("error", _picklable(e)))
        return
    outputs.send(("ready", core.num_gpu_blocks))
    unscheduled: dict[str, Any] = {}  # added, not scheduled yet: their queue time is measured
    num_steps = 0
    try:
        while True:
            # Commands: wait for one while idle, else take what is queued and go on stepping.
            if not core.has_unfinished_requests() or inputs.poll(0):
                batch = [inputs.recv()]
                while inputs.poll(0):
                    batch.append(inputs.recv())
                failed: list[tuple[str, Exception]] = []
                for kind, payload in batch:
                    if kind == "fail_at_step":
                        fail_at_step = payload
                    elif not apply_command(core, kind, payload, unscheduled, failed):
                        return
                if failed:
                    outputs.send(("failed", [(rid, _picklable(e)) for rid, e in failed]))
                if not core.has_unfinished_requests():
                    # Aborts may have emptied the engine: publish the state (0 running, free pool).
                    outputs.send(("outputs", [], core.make_stats(), []))
                    continue
            num_steps += 1
            check_injected_fault(num_steps, fail_at_step)
            step_outputs, queue_times = step_and_queue_times(core, unscheduled)
            outputs.send(("outputs", step_outputs, core.make_stats(), queue_times))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the frontend is gone
    except BaseException as e:  # noqa: BLE001 - the frontend turns this into EngineDeadError
        logger.exception("engine process died")
        try:
            outputs.send(("dead", _picklable(e)))
        except OSError:
            pass


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
            kind, payload = self._outputs.recv()
        except EOFError:
            self.close(0)
            raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode})") from None
        if kind == "error":
            self.close(5)
            raise payload
        assert kind == "ready", kind
        self.num_gpu_blocks = payload

    def send(self, item: tuple[str, Any]) -> None:
        self._inputs.send(item)

    def recv(self) -> tuple[Any, ...]:
        """The next message; EOFError when the engine process is gone."""
        return self._outputs.recv()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the process to stop (it finishes its step), then make sure it has."""
        try:
            self._inputs.send(("shutdown", None))
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
