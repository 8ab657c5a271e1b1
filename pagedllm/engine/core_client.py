"""EngineCoreClient: runs AsyncLLM's EngineCore and carries commands in and step outputs out.

    AsyncLLM (event loop)                 this client                          EngineCore
    ---------------------                 -----------                          ----------
    send("add" | "abort" | "stop") -----> inputs queue
                                          in this process: the engine thread applies the queued
                                          commands, then steps while requests run ------------> step()
                                          engine process (engine/core_proc.py): a sender thread
                                          writes the commands to its pipe, a receiver thread
                                          reads one message per step back
    output thread <---------------------- ("outputs", outputs, stats, queue_times), at most
      (batch_done() when consumed)          MAX_PENDING_BATCHES ahead of the output thread

Where the core runs: vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, here PAGEDLLM_ENABLE_MULTIPROCESSING: "1"
its own process, "0" a thread of this one; unset, a process on the CPU (the step loop gives the GIL up
at every kernel call and must not wait for the event loop's threads to get it back) and a thread on a
GPU. Either way only one thread ever touches the EngineCore, which stays pure and single-threaded.

Failures come back through two callbacks, called on the client's threads: `on_failed` with the
requests the core refused ([(core request id, error)]; the engine lives on) and `on_dead` with the
exception that ended the engine.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.core_proc import EngineCoreProc, multiprocessing_available
from pagedllm.engine.engine_core import (
    FAULT_INJECT_ENV,
    EngineCore,
    apply_command,
    check_injected_fault,
    step_and_queue_times,
    unfreeze_gc_heap,
)
from pagedllm.request import Request

logger = logging.getLogger(__name__)

# How many steps' outputs may wait for the output thread before the engine waits for it:
# backpressure, so a slow detokenizer makes the engine slower instead of a queue longer.
MAX_PENDING_BATCHES = 4
MULTIPROCESSING_ENV = "PAGEDLLM_ENABLE_MULTIPROCESSING"


def _use_engine_process(config: EngineConfig) -> bool:
    choice = os.environ.get(MULTIPROCESSING_ENV)
    if choice not in (None, "", "0", "1"):
        raise ValueError(f"{MULTIPROCESSING_ENV} must be 0 or 1, got {choice!r}.")
    wanted = config.device_config.device == "cpu" if choice in (None, "") else choice == "1"
    return wanted and multiprocessing_available()


class EngineCoreClient:
    def __init__(
        self,
        config: EngineConfig,
        outq: queue.SimpleQueue[tuple[Any, ...]],  # the output thread's queue
        on_failed: Callable[[list[tuple[str, Exception]]], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        fail_at = os.environ.get(FAULT_INJECT_ENV)
        self._fail_at = int(fail_at) if fail_at else None
        # Started first by AsyncLLM, so that in a process the model loads there while the tokenizer
        # loads in the frontend.
        self.core: EngineCore | EngineCoreProc = (
            EngineCoreProc(config, self._fail_at) if _use_engine_process(config) else EngineCore(config)
        )
        self._outq = outq
        self._on_failed = on_failed
        self._on_dead = on_dead
        self._inputs: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._pending_batches = threading.Semaphore(MAX_PENDING_BATCHES)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None  # the engine thread, or the receiver
        self._sender_thread: threading.Thread | None = None  # engine process only
        self._num_steps = 0

    @property
    def in_process(self) -> bool:
        return isinstance(self.core, EngineCore)

    @property
    def num_gpu_blocks(self) -> int | None:
        return self.core.num_gpu_blocks

    @property
    def num_steps(self) -> int:
        """Steps the engine thread has run (an engine process counts its own)."""
        return self._num_steps

    @property
    def fail_at_step(self) -> int | None:
        """Test-only fault injection (FAULT_INJECT_ENV): the engine step that raises."""
        return self._fail_at

    @fail_at_step.setter
    def fail_at_step(self, step: int | None) -> None:
        self._fail_at = step
        if not self.in_process:
            self._inputs.put(("fail_at_step", step))

    def wait_ready(self) -> None:
        """Block until an engine process has loaded the model (raises its start-up error)."""
        if isinstance(self.core, EngineCoreProc):
            self.core.wait_ready()

    def start(self) -> None:
        if self._thread is not None:
            return
        if self.in_process:
            self._thread = threading.Thread(target=self._run_engine_thread, name="pagedllm-engine", daemon=True)
        else:
            self._sender_thread = threading.Thread(target=self._run_sender, name="pagedllm-core-sender", daemon=True)
            self._sender_thread.start()
            self._thread = threading.Thread(target=self._run_receiver, name="pagedllm-core-receiver", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, kind: str, payload: Any = None) -> None:
        """Queue a command: "add" (Requests), "abort" / "stop" (core request ids / {id: stop string})."""
        self._inputs.put((kind, payload))

    def batch_done(self) -> None:
        """The output thread has taken one published step off the queue."""
        self._pending_batches.release()

    def stop(self) -> None:
        """Stop stepping (the engine is dead or shutting down); threads end soon after."""
        self._stopping.set()
        self._inputs.put(("shutdown", None))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop()
        for t in (self._sender_thread, self._thread):
            if t is not None and t.is_alive():
                t.join(timeout)
        if isinstance(self.core, EngineCoreProc):
            self.core.close(timeout)
        else:
            unfreeze_gc_heap()  # the in-process engine was frozen at start; let it be collected

    def _publish(self, outputs: list[Any], stats: SchedulerStats, queue_times: list[float]) -> bool:
        """Hand one step's outputs to the output thread; waits while it is MAX_PENDING_BATCHES
        behind. False when stopping."""
        while not self._pending_batches.acquire(timeout=0.2):
            if self._stopping.is_set():
                return False
        self._outq.put(("outputs", outputs, stats, queue_times))
        return True

    # -- in this process ---------------------------------------------------------------------------
    def _run_engine_thread(self) -> None:
        core = self.core
        assert isinstance(core, EngineCore)
        unscheduled: dict[str, Request] = {}  # added, not scheduled yet: their queue time is measured
        try:
            while True:
                if not self._apply_inputs(core, block=not core.has_unfinished_requests(), unscheduled=unscheduled):
                    return
                if not core.has_unfinished_requests():
                    # Aborts may have emptied the engine: publish the state (0 running, free pool).
                    if not self._publish([], core.make_stats(), []):
                        return
                    continue
                self._num_steps += 1
                check_injected_fault(self._num_steps, self._fail_at)
                outputs, queue_times = step_and_queue_times(core, unscheduled)
                if not self._publish(outputs, core.make_stats(), queue_times):
                    return
        except BaseException as e:  # noqa: BLE001 - anything that kills the thread kills the engine
            logger.exception("engine thread died")
            self._on_dead(e)

    def _apply_inputs(self, core: EngineCore, block: bool, unscheduled: dict[str, Request]) -> bool:
        """Apply every queued command; False on shutdown. Blocks for the first one only when idle."""
        try:
            item = self._inputs.get(block=block)
        except queue.Empty:
            return True
        failed: list[tuple[str, Exception]] = []
        while True:
            kind, payload = item
            # "fail_at_step" is read from self._fail_at by the engine thread itself.
            if kind != "fail_at_step" and not apply_command(core, kind, payload, unscheduled, failed):
                return False
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                break
        if failed:
            self._on_failed(failed)
        return True

    # -- engine process ----------------------------------------------------------------------------
    def _run_sender(self) -> None:
        """Forward commands to the engine process, in order; ends after sending "shutdown"."""
        assert isinstance(self.core, EngineCoreProc)
        try:
            while True:
                item = self._inputs.get()
                self.core.send(item)
                if item[0] == "shutdown":
                    return
        except OSError:
            pass  # the engine process is gone; the receiver reports it

    def _run_receiver(self) -> None:
        """Publish the engine process's step outputs (MAX_PENDING_BATCHES ahead at most: then the
        engine process blocks on its pipe) and report its failures."""
        core = self.core
        assert isinstance(core, EngineCoreProc)
        try:
            while True:
                try:
                    msg = core.recv()
                except (EOFError, OSError):
                    if self._stopping.is_set():
                        return
                    raise RuntimeError(f"the engine process exited (exit code {core.process.exitcode})") from None
                kind = msg[0]
                if kind == "outputs":
                    if not self._publish(msg[1], msg[2], msg[3]):
                        return
                elif kind == "failed":
                    self._on_failed(msg[1])
                elif kind == "dead":
                    raise msg[1]
                else:
                    raise AssertionError(f"unknown engine message {kind!r}")
        except BaseException as e:  # noqa: BLE001 - anything that ends the engine ends the server
            if not self._stopping.is_set():
                logger.error("engine process died: %s: %s", type(e).__name__, e)
                self._on_dead(e)
