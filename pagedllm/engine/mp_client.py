"""MPClient: AsyncLLM's engine core in its own process (engine/core_proc.py), the default transport.

    AsyncLLM ---send()---> queue ---sender thread: encode, write---> engine process
    AsyncLLM <---outq/callbacks--- receiver thread: read, decode <--- engine process

Every request's commands pass the one sender thread and every reply the one receiver thread, so
neither may stop for one message: a command that cannot be encoded fails the requests it carries
(`_unsendable`, naming the value), a reply that cannot be decoded fails the requests it concerns and
keeps the rest (`_unreadable`; engine/bad_messages.py). What ends them: Shutdown, the engine process's
EngineDead, or its pipe closing (reported as a dead engine).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from pagedllm.config import EngineConfig
from pagedllm.engine.bad_messages import salvage_reply, unencodable_path
from pagedllm.engine.core_client import EngineCoreClient, FailedCallback, OutputSink, _settle
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.messages import (
    AddRequests,
    EngineCoreCommand,
    EngineCoreReply,
    EngineDead,
    ResetPrefixCache,
    Shutdown,
    encode,
    reply_decoder,
)

logger = logging.getLogger(__name__)


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
