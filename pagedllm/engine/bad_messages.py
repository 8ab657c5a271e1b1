"""What can still be read of an engine message that cannot be encoded or decoded.

One bad message must cost one request, never the engine or the thread that carries every request's
messages. So each side of the wire that meets one asks this module which requests it concerns and
answers them with an error, then goes on:

    where                               bad message                        who gets the error
    -----                               -----------                        ------------------
    frontend sender thread (encode)     a command with a value msgspec      the requests it carries
                                        cannot write (numpy scalar, an      (`unencodable_path` names
                                        int past 64 bits, a lone surrogate)  the field)
    engine process (decode)             a frame it cannot read              `command_request_ids`
    engine process (encode)             one step's output it cannot write   that output's request
                                                                            (`split_step_outputs`)
    frontend receiver thread (decode)   a reply it cannot read              `salvage_reply`

A worked example: AddRequests([r("a-0") with sampling_params.seed = 2**70]) cannot be encoded;
`unencodable_path` gives "requests[0].sampling_params.seed (int 1180591620717411303424)" and request
"a-0" fails with a message naming it while every other request is served.
"""

from __future__ import annotations

import dataclasses
import re
import typing

import msgspec

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.messages import (
    EngineCoreCommand,
    EngineCoreReply,
    ErrorInfo,
    RequestFailure,
    RequestsFailed,
    StepOutputs,
    _dec_hook,
    _encoder,
)

# What an encoder raises for a value it cannot write: msgspec's own error, the hook's NotImplementedError
# (an unsupported type), OverflowError (an int past 64 bits), UnicodeEncodeError (a lone surrogate).
ENCODE_ERRORS = (msgspec.EncodeError, TypeError, ValueError, OverflowError, NotImplementedError)

_MAX_REPR = 80


def _encodes(obj: object) -> bool:
    try:
        _encoder.encode(obj)
        return True
    except ENCODE_ERRORS:
        return False


def _describe(obj: object) -> str:
    text = repr(obj) if isinstance(obj, (str, bytes)) else str(obj)  # repr shows a lone surrogate
    if len(text) > _MAX_REPR:
        text = text[:_MAX_REPR] + "..."
    kind = type(obj)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"{name} {text}"


def unencodable_path(obj: object, path: str = "") -> str | None:
    """The first value inside `obj` that cannot be encoded, as a path and the value's type:
    "requests[0].sampling_params.temperature (numpy.float64 0.5)"; None when `obj` encodes."""
    if _encodes(obj):
        return None
    children: list[tuple[str, object]] = []
    if isinstance(obj, msgspec.Struct):
        children = [(f"{path}.{name}", getattr(obj, name)) for name in obj.__struct_fields__]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        children = [(f"{path}.{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif isinstance(obj, dict):
        for k, v in obj.items():
            children += [(f"{path} key", k), (f"{path}[{k!r}]", v)]
    for child_path, child in children:
        found = unencodable_path(child, child_path)
        if found is not None:
            return found
    return f"{path.lstrip('.') or 'the message'} ({_describe(obj)})"


def _raw(frame: bytes) -> object:
    """The frame as plain msgpack values (lists, dicts, ...), or None when it is not msgpack at all."""
    try:
        return msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None


_MESSAGES = {cls.__name__: cls for cls in typing.get_args(EngineCoreCommand) + typing.get_args(EngineCoreReply)}
_WIRE_PATH = re.compile(r"`\$((?:\[\d+\]|\.\w+)*)`")


def named_path(cls: type, wire_path: str) -> str:
    """msgspec's path into a message (array-like structs are arrays: fields by position) as field
    names: AddRequests, "[1][0][2].max_tokens" -> "requests[0].sampling_params.max_tokens" (a
    tagged struct's first element is its tag)."""
    out, kind, tagged = "", cls, True
    for index, name in re.findall(r"\[(\d+)\]|\.(\w+)", wire_path):
        if name:  # a map's key: a dataclass field (SamplingParams) by name
            hints = typing.get_type_hints(kind) if dataclasses.is_dataclass(kind) else {}
            out, kind = f"{out}.{name}", hints.get(name)
        elif isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            fields = msgspec.structs.fields(kind)
            i = int(index) - (1 if tagged and kind.__struct_config__.tag else 0)
            if not 0 <= i < len(fields):
                return f"{out}[{index}]".lstrip(".")
            out, kind = f"{out}.{fields[i].name}", fields[i].type
        else:  # a list's element
            args = typing.get_args(kind)
            out, kind = f"{out}[{index}]", args[0] if args else None
        tagged = False
    return out.lstrip(".")


def _in_field_names(cls: type, error: Exception) -> str:
    return _WIRE_PATH.sub(lambda mt: named_path(cls, mt.group(1)) or cls.__name__, str(error))


def readable_decode_error(frame: bytes, error: Exception) -> str:
    """A decoder's error with its wire path in field names, where the frame's tag names a message:
    "Expected `int | null`, got `str` - at `$[1][0][2].max_tokens`" -> "... - at
    requests[0].sampling_params.max_tokens"."""
    raw = _raw(frame)
    cls = _MESSAGES.get(raw[0]) if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
    return str(error) if cls is None else _in_field_names(cls, error)


def command_request_ids(frame: bytes) -> list[str]:
    """The ids of the requests an undecodable command frame was adding, where they can be read.
    Messages are tagged arrays: AddRequests([EngineCoreRequest]) is ["AddRequests", [[id, ...], ...]]."""
    raw = _raw(frame)
    if not (isinstance(raw, list) and len(raw) >= 2 and raw[0] == "AddRequests" and isinstance(raw[1], list)):
        return []
    return [r[0] for r in raw[1] if isinstance(r, list) and r and isinstance(r[0], str)]


def split_step_outputs(reply: StepOutputs) -> tuple[StepOutputs, RequestsFailed]:
    """A StepOutputs that would not encode: the step without the outputs that do not, and a failure
    for each of those requests naming the value. Stats that do not encode lose their KV map (the
    console's picture skips one step); what still fails to encode then is the engine's own bug."""
    good: list[EngineCoreOutput] = []
    failures: list[RequestFailure] = []
    for i, out in enumerate(reply.outputs):
        where = unencodable_path(out, f"outputs[{i}]")
        if where is None:
            good.append(out)
        elif isinstance(out.request_id, str) and _encodes(out.request_id):
            why = RuntimeError(f"the engine could not send this request's output: {where} cannot be encoded")
            failures.append(RequestFailure(out.request_id, ErrorInfo.from_exception(why)))
    stats = reply.stats
    if not _encodes(stats):
        stats = dataclasses.replace(stats, kv_block_map=None)
    return StepOutputs(good, stats, reply.queue_times, reply.num_steps), RequestsFailed(failures)


class _OutputId(msgspec.Struct):
    request_id: str  # an EngineCoreOutput (a dataclass: a map on the wire) read for its id alone


class _LenientStepOutputs(msgspec.Struct, tag="StepOutputs", array_like=True):
    outputs: list[msgspec.Raw]  # each read on its own
    stats: SchedulerStats
    queue_times: list[float]
    num_steps: int


_lenient_step = msgspec.msgpack.Decoder(_LenientStepOutputs, dec_hook=_dec_hook)
_output_decoder = msgspec.msgpack.Decoder(EngineCoreOutput, dec_hook=_dec_hook)
_output_id_decoder = msgspec.msgpack.Decoder(_OutputId)


def salvage_reply(frame: bytes, error: Exception) -> tuple[EngineCoreReply | None, dict[str, str]]:
    """A reply frame the typed decoder refused (`error`): what of it can be used, and
    {request id: why it failed} for the requests it concerned.

    A StepOutputs whose envelope reads keeps its readable outputs (the step's stats and its place in
    the backpressure count stay); each unreadable output fails its request. Otherwise no reply, and
    the requests found in the raw frame (a step's outputs, a RequestsFailed's ids) fail."""
    why = "the engine's reply for this request could not be read"
    try:
        step = _lenient_step.decode(frame)
    except (msgspec.DecodeError, NotImplementedError, ValueError, TypeError):
        step = None
    if step is not None:
        good, failed = [], {}
        for raw in step.outputs:
            try:
                good.append(_output_decoder.decode(raw))
            except (msgspec.DecodeError, NotImplementedError, ValueError, TypeError) as e:
                try:
                    failed[_output_id_decoder.decode(raw).request_id] = f"{why}: {_in_field_names(EngineCoreOutput, e)}"
                except msgspec.DecodeError:
                    pass  # not even an id: nobody to tell
        return StepOutputs(good, step.stats, step.queue_times, step.num_steps), failed
    raw = _raw(frame)
    ids: list[str] = []
    if isinstance(raw, list) and len(raw) >= 2 and isinstance(raw[1], list):
        if raw[0] == "StepOutputs":
            ids = [o["request_id"] for o in raw[1] if isinstance(o, dict) and isinstance(o.get("request_id"), str)]
        elif raw[0] == "RequestsFailed":
            ids = [f[0] for f in raw[1] if isinstance(f, list) and f and isinstance(f[0], str)]
    return None, dict.fromkeys(ids, f"{why}: {readable_decode_error(frame, error)}")
