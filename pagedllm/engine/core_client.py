"""EngineCoreClient: runs AsyncLLM's EngineCore and carries commands in and step outputs out.

    AsyncLLM (event loop)                 this client                          EngineCore
    ---------------------                 -----------                          ----------
    send(AddRequests | AbortRequests ...)-> InprocClient: a queue; the engine thread runs
                                          EngineCoreLoop (engine/core_loop.py) ------------> step()
                                          MPClient: a sender thread writes the commands to
                                          the engine process (engine/core_proc.py), a
                                          receiver thread reads its replies back
    event loop <------------------------- StepOutputs (through output_pump.py), at most
      (batch_done() when consumed)          MAX_PENDING_BATCHES ahead of the loop

Both clients speak the same typed messages (engine/messages.py) and hand every reply to
`_handle_reply`; only the transport differs. `EngineCoreClient.make_client` picks one. InprocClient
is here, MPClient in engine/mp_client.py.

Where the core runs: vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, here PAGEDLLM_ENABLE_MULTIPROCESSING: "1"
(the default) its own process, "0" a thread of this one. In one process the step loop and the event
loop share a GIL: on the CPU the step loop gives it up at every kernel call, on a GPU at every launch
and sync, and each time waits for the frontend's Python to hand it back (BENCHMARKS.md, issue 16).
Either way only one thread ever touches the EngineCore, which stays pure and single-threaded.

Failures come back through two callbacks, called on the client's threads: `on_failed` with the
requests the core refused ({core request id: error}; the engine lives on) and `on_dead` with the
exception that ended the engine. A message that cannot cross the process boundary (a command the
sender cannot encode, a reply the receiver cannot decode) fails the requests it concerns through
`on_failed` and the thread goes on with the next one (engine/mp_client.py, engine/bad_messages.py):
one bad message never stops the threads every request's messages go through.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

import pagedllm.envs as envs
from pagedllm.config import EngineConfig
from pagedllm.engine.core_loop import EngineCoreLoop
from pagedllm.engine.core_proc import multiprocessing_available
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.gc_heap import unfreeze_gc_heap
from pagedllm.engine.messages import (
    EngineCoreCommand,
    EngineCoreReply,
    EngineDead,
    ErrorInfo,
    InjectFault,
    PrefixCacheReset,
    RequestsFailed,
    ResetPrefixCache,
    Shutdown,
    StepOutputs,
)

logger = logging.getLogger(__name__)

class OutputSink(Protocol):
    def put(self, item: Any) -> None: ...


# How many steps' outputs may wait for the frontend before the engine waits for it:
# backpressure, so a slow detokenizer makes the engine slower instead of a queue longer.
MAX_PENDING_BATCHES = 4
# The variables' names, for tests that set them (pagedllm/envs.py reads and documents them).
MULTIPROCESSING_ENV = "PAGEDLLM_ENABLE_MULTIPROCESSING"
FAULT_INJECT_ENV = "PAGEDLLM_TEST_FAIL_AT_STEP"

FailedCallback = Callable[[dict[str, BaseException]], None]  # core request id -> why the core refused it


def _use_engine_process(config: EngineConfig) -> bool:
    choice = envs.PAGEDLLM_ENABLE_MULTIPROCESSING
    wanted = True if choice is None else choice
    return wanted and multiprocessing_available()


class EngineCoreClient(ABC):
    """AsyncLLM's handle on its engine core, wherever that runs."""

    in_process: bool

    @staticmethod
    def make_client(
        config: EngineConfig,
        outq: OutputSink,  # StepOutputs go there (AsyncLLM's OutputPump)
        on_failed: FailedCallback,
        on_dead: Callable[[BaseException], None],
    ) -> EngineCoreClient:
        if not _use_engine_process(config):
            return InprocClient(config, outq, on_failed, on_dead)
        from pagedllm.engine.mp_client import MPClient  # here: mp_client imports this module

        return MPClient(config, outq, on_failed, on_dead)

    def __init__(self, config: EngineConfig, outq: OutputSink,
                 on_failed: FailedCallback,
                 on_dead: Callable[[BaseException], None]) -> None:
        # The fault-injection test hook, armed from the environment for tests that start a server.
        self._fail_at = envs.PAGEDLLM_TEST_FAIL_AT_STEP
        self._outq = outq
        self._on_failed = on_failed
        self._on_dead = on_dead
        # A counting semaphore as a queue of MAX_PENDING_BATCHES permits: SimpleQueue's put and get are C
        # (threading.Semaphore is a Condition in Python; its release, once per step on the event loop,
        # was 5% of the frontend's samples at 256 streams, BENCHMARKS.md issue 16, h39).
        self._pending_batches: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(MAX_PENDING_BATCHES):
            self._pending_batches.put(None)
        self._stopping = threading.Event()
        self._num_steps = 0
        self._call_ids = itertools.count()
        self._calls: dict[int, Future] = {}  # utility commands waiting for their reply

    # -- what both transports share ----------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        """Steps the engine core has run (as of the newest StepOutputs received)."""
        return self._num_steps

    @property
    def fail_at_step(self) -> int | None:
        """Test-only fault injection: the engine step that raises (InjectFault)."""
        return self._fail_at

    @fail_at_step.setter
    def fail_at_step(self, step: int | None) -> None:
        self._fail_at = step
        self.send(InjectFault(step))

    def reset_prefix_cache(self) -> Future:
        """Ask the core to drop its prefix cache; the future's result says whether it did."""
        fut: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = fut
        self.send(ResetPrefixCache(call_id))
        return fut

    def batch_done(self) -> None:
        """The frontend has taken one published step off the queue."""
        self._pending_batches.put(None)

    def stop(self) -> None:
        """Stop stepping (the engine is dead or shutting down); threads end soon after."""
        self._stopping.set()
        self.send(Shutdown())

    def _handle_reply(self, reply: EngineCoreReply) -> bool:
        """Route one reply from the core; False when stopping (the core should stop too)."""
        match reply:
            case StepOutputs():
                self._num_steps = reply.num_steps
                # Wait while the frontend is MAX_PENDING_BATCHES behind.
                while True:
                    try:
                        self._pending_batches.get(timeout=0.2)
                        break
                    except queue.Empty:
                        if self._stopping.is_set():
                            return False
                self._outq.put(reply)
            case RequestsFailed(failures=failures):
                self._on_failed({f.request_id: f.error.to_exception() for f in failures})
            case PrefixCacheReset(call_id=call_id, ok=ok):
                fut = self._calls.pop(call_id, None)
                if fut is not None:
                    _settle(fut, ok)
            case EngineDead(error=error):
                self._report_dead(error.to_exception())
                return False
            case _:
                raise AssertionError(f"unexpected engine reply {reply!r}")
        return True

    def _report_dead(self, error: BaseException) -> None:
        for fut in self._calls.values():
            _settle(fut, error=error)
        self._calls.clear()
        self._on_dead(error)

    # -- what each transport implements ------------------------------------------------------------
    @property
    @abstractmethod
    def num_gpu_blocks(self) -> int | None: ...

    @abstractmethod
    def wait_ready(self) -> None:
        """Block until the core has loaded the model (raises its start-up error)."""

    @abstractmethod
    def start(self) -> None: ...

    @abstractmethod
    def is_alive(self) -> bool: ...

    @abstractmethod
    def send(self, command: EngineCoreCommand) -> None:
        """Queue a command for the core (applied before its next step)."""

    @abstractmethod
    def shutdown(self, timeout: float = 5.0) -> None: ...


class InprocClient(EngineCoreClient):
    """The EngineCore in a thread of this process: commands on a queue, replies handled in place."""

    in_process = True

    def __init__(self, config: EngineConfig, outq: OutputSink,
                 on_failed: FailedCallback,
                 on_dead: Callable[[BaseException], None]) -> None:
        super().__init__(config, outq, on_failed, on_dead)
        self.core = EngineCore(config)
        self._inputs: queue.SimpleQueue[EngineCoreCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def num_gpu_blocks(self) -> int | None:
        return self.core.num_gpu_blocks

    def wait_ready(self) -> None:
        pass  # built in __init__

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def send(self, command: EngineCoreCommand) -> None:
        self._inputs.put(command)

    def _next_commands(self, block: bool) -> list[EngineCoreCommand]:
        try:
            batch = [self._inputs.get(block=block)]
        except queue.Empty:
            return []
        while True:
            try:
                batch.append(self._inputs.get_nowait())
            except queue.Empty:
                return batch

    def _run(self) -> None:
        loop = EngineCoreLoop(self.core, self._handle_reply, self._fail_at)
        try:
            loop.run(self._next_commands)
        except BaseException as e:  # noqa: BLE001 - anything that kills the thread kills the engine
            logger.exception("engine thread died")
            self._handle_reply(EngineDead(ErrorInfo.from_exception(e)))

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        unfreeze_gc_heap()  # the in-process engine was frozen at start; let it be collected


def _settle(fut: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Complete a utility call's future, unless its caller gave up (asyncio.wrap_future cancels it
    when the awaiting task is cancelled: a disconnected client). Not an error either way."""
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


def __getattr__(name: str) -> Any:
    """`from pagedllm.engine.core_client import MPClient`, its import path before engine/mp_client.py."""
    if name == "MPClient":
        from pagedllm.engine.mp_client import MPClient

        return MPClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
