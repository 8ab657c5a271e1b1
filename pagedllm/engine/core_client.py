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
`_handle_reply`; only the transport differs. `EngineCoreClient.make_client` picks one.

Where the core runs: vLLM's VLLM_ENABLE_V1_MULTIPROCESSING, here PAGEDLLM_ENABLE_MULTIPROCESSING: "1"
(the default) its own process, "0" a thread of this one. In one process the step loop and the event
loop share a GIL: on the CPU the step loop gives it up at every kernel call, on a GPU at every launch
and sync, and each time waits for the frontend's Python to hand it back (BENCHMARKS.md, issue 16).
Either way only one thread ever touches the EngineCore, which stays pure and single-threaded.

Failures come back through two callbacks, called on the client's threads: `on_failed` with the
requests the core refused ({core request id: error}; the engine lives on) and `on_dead` with the
exception that ended the engine. A message that cannot cross the process boundary (a command the
sender cannot encode, a reply the receiver cannot decode) fails the requests it concerns through
`on_failed` and the thread goes on with the next one (engine/bad_messages.py): one bad message never
stops the threads every request's messages go through.
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
from pagedllm.engine.bad_messages import salvage_reply, unencodable_path
from pagedllm.engine.core_loop import EngineCoreLoop
from pagedllm.engine.core_proc import EngineCoreProc, multiprocessing_available
from pagedllm.engine.engine_core import EngineCore, unfreeze_gc_heap
from pagedllm.engine.messages import (
    AddRequests,
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
    encode,
    reply_decoder,
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
        cls = MPClient if _use_engine_process(config) else InprocClient
        return cls(config, outq, on_failed, on_dead)

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

    def _unsendable(self, command: EngineCoreCommand, error: Exception) -> None:
        """A command the sender could not encode: what it carried fails, naming the value."""
        where = unencodable_path(command)
        detail = f"{where} cannot be encoded" if where is not None else f"{type(error).__name__}: {error}"
        match command:
            case AddRequests(requests=requests):
                ids = [r.request_id for r in requests]
                logger.error("request(s) %s could not be sent to the engine: %s", ", ".join(map(repr, ids)), detail)
                why = RuntimeError(f"the request could not be sent to the engine: {detail}")
                self._on_failed(dict.fromkeys(ids, why))
            case ResetPrefixCache(call_id=call_id):
                fut = self._calls.pop(call_id, None)
                if fut is not None:
                    _settle(fut, error=RuntimeError(f"reset_prefix_cache could not be sent to the engine: {detail}"))
            case _:
                logger.error("a %s command could not be sent to the engine and was dropped: %s",
                             type(command).__name__, detail)

    def _unreadable(self, frame: bytes, error: Exception) -> EngineCoreReply | None:
        """A reply the receiver could not decode: what of it can be used (engine/bad_messages.py);
        the requests it concerned fail (AsyncLLM then aborts them in the engine)."""
        try:
            reply, failed = salvage_reply(frame, error)
        except Exception:  # noqa: BLE001 - then nothing of it is used; the receiver goes on
            logger.exception("reading what remains of an undecodable reply failed")
            reply, failed = None, {}
        logger.error("a reply of %d bytes from the engine could not be decoded (%s: %s); %s", len(frame),
                     type(error).__name__, error,
                     f"failing request(s) {', '.join(map(repr, failed))}" if failed else "no request to fail")
        if failed:
            self._on_failed({rid: RuntimeError(why) for rid, why in failed.items()})
        return reply

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


class MPClient(EngineCoreClient):
    """The EngineCore in its own process (engine/core_proc.py): msgpack frames both ways."""

    in_process = False

    def __init__(self, config: EngineConfig, outq: OutputSink,
                 on_failed: FailedCallback,
                 on_dead: Callable[[BaseException], None]) -> None:
        super().__init__(config, outq, on_failed, on_dead)
        # Started first by AsyncLLM, so the model loads there while the tokenizer loads here.
        self.core = EngineCoreProc.start(config, self._fail_at)  # the prestarted process, if it fits
        self._inputs: queue.SimpleQueue[EngineCoreCommand] = queue.SimpleQueue()
        self._sender_thread: threading.Thread | None = None
        self._receiver_thread: threading.Thread | None = None

    @property
    def num_gpu_blocks(self) -> int | None:
        return self.core.num_gpu_blocks

    def wait_ready(self) -> None:
        self.core.wait_ready()

    def start(self) -> None:
        if self._receiver_thread is not None:
            return
        self._sender_thread = threading.Thread(target=self._run_sender, name="pagedllm-core-sender", daemon=True)
        self._sender_thread.start()
        self._receiver_thread = threading.Thread(target=self._run_receiver, name="pagedllm-core-receiver",
                                                 daemon=True)
        self._receiver_thread.start()

    def is_alive(self) -> bool:
        return self._receiver_thread is not None and self._receiver_thread.is_alive()

    def send(self, command: EngineCoreCommand) -> None:
        self._inputs.put(command)

    def _run_sender(self) -> None:
        """Forward commands to the engine process, in order; ends after sending Shutdown, or when the
        process is gone (the receiver reports that). A command that cannot be encoded fails what it
        carried and the next one goes."""
        while True:
            command = self._inputs.get()
            try:
                frame = encode(command)
            except Exception as e:  # noqa: BLE001 - this command's problem alone
                try:
                    self._unsendable(command, e)
                except Exception:  # noqa: BLE001 - the thread must live on for the other requests
                    logger.exception("failing an unsendable %s failed", type(command).__name__)
                continue
            try:
                self.core.send_frame(frame)
            except OSError:
                return
            if isinstance(command, Shutdown):
                return

    def _run_receiver(self) -> None:
        """Route the engine process's replies (StepOutputs MAX_PENDING_BATCHES ahead at most: then
        the engine process blocks on its pipe) and report its death."""
        try:
            while True:
                try:
                    frames = self.core.recv_frames()  # what has arrived: one read (and GIL wait) for all
                except (EOFError, OSError):
                    if self._stopping.is_set():
                        return
                    raise RuntimeError(f"the engine process exited (exit code {self.core.process.exitcode})") from None
                for frame in frames:
                    try:
                        reply = reply_decoder.decode(frame)
                    except Exception as e:  # noqa: BLE001 - this frame's problem alone
                        reply = self._unreadable(frame, e)
                        if reply is None:
                            continue
                    if isinstance(reply, EngineDead):
                        if not self._stopping.is_set():
                            logger.error("engine process died: %s: %s", reply.error.type_name, reply.error.message)
                            self._report_dead(reply.error.to_exception())
                        return
                    if not self._handle_reply(reply):
                        return
        except BaseException as e:  # noqa: BLE001 - anything that ends the engine ends the server
            if not self._stopping.is_set():
                logger.error("engine process died: %s: %s", type(e).__name__, e)
                self._report_dead(e)

    def shutdown(self, timeout: float = 5.0) -> None:
        self.stop()
        for t in (self._sender_thread, self._receiver_thread):
            if t is not None and t.is_alive():
                t.join(timeout)
        self.core.close(timeout)


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
