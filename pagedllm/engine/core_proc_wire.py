"""The engine process's two pipes, as EngineCoreLoop's `next_commands` and `emit`: a bad message is
answered, never fatal.

    frontend --frames--> CommandReader: decode each frame on its own; one that does not decode is
                         logged and its requests (where their ids can be read) get RequestsFailed;
                         the loop goes on with the rest
    frontend <--frames-- ReplyWriter: a StepOutputs that does not encode goes without the outputs
                         that do not, and those requests get RequestsFailed (engine/bad_messages.py)

What still ends the engine: the pipes closing (the frontend is gone) and an exception inside a step
(reported as EngineDead by run_engine_core, engine/core_proc_main.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from multiprocessing.connection import Connection

from pagedllm.engine.bad_messages import (
    ENCODE_ERRORS,
    command_request_ids,
    readable_decode_error,
    split_step_outputs,
)
from pagedllm.engine.messages import (
    EngineCoreCommand,
    EngineCoreReply,
    ErrorInfo,
    RequestFailure,
    RequestsFailed,
    StepOutputs,
    command_decoder,
    encode,
)

logger = logging.getLogger(__name__)


class ReplyWriter:
    """EngineCoreLoop's `emit` in the engine process: each reply as one frame on the output pipe."""

    def __init__(self, outputs: Connection) -> None:
        self._outputs = outputs

    def __call__(self, reply: EngineCoreReply) -> bool:
        try:
            frame = encode(reply)
        except ENCODE_ERRORS as e:
            if not isinstance(reply, StepOutputs):
                raise  # the engine's own messages (Ready, PrefixCacheReset, ...) always encode: a bug
            step, failed = split_step_outputs(reply)
            logger.error("engine process: %d output(s) of step %d could not be encoded (%s: %s); their "
                         "requests fail", len(failed.failures), reply.num_steps, type(e).__name__, e)
            self._outputs.send_bytes(encode(step))
            if failed.failures:
                self._outputs.send_bytes(encode(failed))
            return True
        self._outputs.send_bytes(frame)
        return True


class CommandReader:
    """EngineCoreLoop's `next_commands` in the engine process: waits for one command while idle
    (`block`), else takes what is queued. `emit` answers the requests of a frame it cannot decode."""

    def __init__(self, inputs: Connection, emit: Callable[[EngineCoreReply], bool]) -> None:
        self._inputs = inputs
        self._emit = emit

    def __call__(self, block: bool) -> list[EngineCoreCommand]:
        if not block and not self._inputs.poll(0):
            return []
        batch: list[EngineCoreCommand] = []
        self._read_one(batch)
        while self._inputs.poll(0):
            self._read_one(batch)
        return batch  # empty when every frame was bad: the loop asks again

    def _read_one(self, batch: list[EngineCoreCommand]) -> None:
        frame = self._inputs.recv_bytes()  # EOFError: the frontend is gone (run_engine_core ends)
        try:
            batch.append(command_decoder.decode(frame))
        except Exception as e:  # noqa: BLE001 - msgspec's errors, or a __post_init__'s: this frame's alone
            self._refuse(frame, e)

    def _refuse(self, frame: bytes, error: Exception) -> None:
        ids = command_request_ids(frame)
        error_text = readable_decode_error(frame, error)
        logger.error("engine process: a command of %d bytes could not be decoded (%s: %s); %s", len(frame),
                     type(error).__name__, error_text,
                     f"failing its requests {', '.join(ids)}" if ids else "no request to answer, ignored")
        if ids:
            why = ErrorInfo.from_exception(RuntimeError(f"the engine could not read this request: {error_text}"))
            self._emit(RequestsFailed([RequestFailure(rid, why) for rid in ids]))
