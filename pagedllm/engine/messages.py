"""Typed messages between AsyncLLM's client and the engine core: one class per command and reply.

    frontend -> core (EngineCoreCommand)        core -> frontend (EngineCoreReply)
    ------------------------------------        ----------------------------------
    AddRequests        queue requests           Ready             model loaded, blocks counted
    AbortRequests      free them now            StartupFailed     the core could not start
    StopRequests       a stop string was found  StepOutputs       one step: outputs, stats, queue times
    ResetPrefixCache   forget cached prefixes   RequestsFailed    requests the core refused
    InjectFault        test hook (tests only)   PrefixCacheReset  the answer to ResetPrefixCache
    Shutdown           finish the step, stop    EngineDead        a step raised: the engine is gone

The core's loop (engine/core_loop.py) dispatches them with `match`, in a thread of the frontend's
process or in the engine process (engine/core_proc.py): the same classes either way. Across the
process boundary they travel as msgpack (`encode` / the decoders below), never as pickle. A new
command is one class here, one member of the union and one `case` in the loop.

Errors cross as `ErrorInfo` (type name and message) and come back as the same builtin exception
type where it is one of `_REBUILT_ERRORS` (a ValueError stays a ValueError: the server answers 400),
else as a RuntimeError that names the original type.
"""

from __future__ import annotations

from typing import Union

import msgspec
import torch

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.pooling.params import PoolingParams
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """A request as the core needs it: token ids and sampling parameters, no text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_salt: str | None
    # SamplingParams.all_stop_token_ids is derived (stop ids + the model's EOS ids) and rebuilt by
    # its __post_init__ when decoded, so it travels here and is put back.
    all_stop_token_ids: list[int]
    pooling_params: PoolingParams | None = None  # a pooling request (pooling/)

    def __post_init__(self) -> None:
        self.sampling_params.all_stop_token_ids = set(self.all_stop_token_ids)

    @classmethod
    def from_request(cls, req: Request) -> EngineCoreRequest:
        sp = req.sampling_params
        return cls(req.request_id, req.prompt_token_ids, sp, req.arrival_time, req.cache_salt,
                   sorted(sp.all_stop_token_ids), req.pooling_params)

    def to_request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling_params, self.arrival_time,
                       self.cache_salt, pooling_params=self.pooling_params)


class ErrorInfo(msgspec.Struct, array_like=True):
    type_name: str
    message: str

    @classmethod
    def from_exception(cls, e: BaseException) -> ErrorInfo:
        # A message may quote a client's text, and JSON's "\ud800" is a lone surrogate UTF-8 cannot
        # carry: escaped, so the error itself always encodes.
        return cls(type(e).__name__, str(e).encode("utf-8", "backslashreplace").decode("utf-8"))

    def to_exception(self) -> BaseException:
        cls = _REBUILT_ERRORS.get(self.type_name)
        if cls is not None:
            return cls(self.message)
        return RuntimeError(f"{self.type_name}: {self.message}")


_REBUILT_ERRORS: dict[str, type[BaseException]] = {
    c.__name__: c
    for c in (ValueError, TypeError, KeyError, RuntimeError, MemoryError, NotImplementedError, OSError,
              AssertionError, TimeoutError)
}


# -- frontend -> core --------------------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]  # core request ids


class StopRequests(msgspec.Struct, tag=True, array_like=True):
    stops: dict[str, str]  # core request id -> the stop string the frontend's detokenizer found


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    call_id: int  # echoed in PrefixCacheReset


class InjectFault(msgspec.Struct, tag=True, array_like=True):
    """Test hook: raise inside engine step `at_step` (1-based, counted by the loop) and after;
    None disarms it. Lets tests see a dying engine fail in-flight requests."""

    at_step: int | None


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


EngineCoreCommand = Union[AddRequests, AbortRequests, StopRequests, ResetPrefixCache, InjectFault, Shutdown]


# -- core -> frontend --------------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    num_gpu_blocks: int


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    error: ErrorInfo


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    queue_times: list[float]  # seconds in queue of the requests this step scheduled first
    num_steps: int  # steps the loop has run so far (this one included)


class RequestFailure(msgspec.Struct, array_like=True):
    request_id: str
    error: ErrorInfo


class RequestsFailed(msgspec.Struct, tag=True, array_like=True):
    failures: list[RequestFailure]


class PrefixCacheReset(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    ok: bool  # False while requests run (nothing was reset)


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    error: ErrorInfo


EngineCoreReply = Union[Ready, StartupFailed, StepOutputs, RequestsFailed, PrefixCacheReset, EngineDead]


# -- the wire ----------------------------------------------------------------------------------------
def _enc_hook(obj: object) -> object:
    """A pooled output (EngineCoreOutput.pooling_output) travels as (shape, float32 bytes)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().to("cpu", torch.float32).contiguous()
        return [list(t.shape), t.numpy().tobytes()]
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: object) -> object:
    if kind is torch.Tensor:
        shape, data = obj  # type: ignore[misc]
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
command_decoder = msgspec.msgpack.Decoder(EngineCoreCommand)
reply_decoder = msgspec.msgpack.Decoder(EngineCoreReply, dec_hook=_dec_hook)


def encode(msg: EngineCoreCommand | EngineCoreReply) -> bytes:
    return _encoder.encode(msg)
