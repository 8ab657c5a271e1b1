"""What the chat and completions endpoints share: model check, sampling parameters, queueing a
request in the engine (errors -> OpenAI 400s), logprob formatting, request logging, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, TypeVar

from pydantic import BaseModel

from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.output_stream import RequestOutputStream
from pagedllm.entrypoints.openai.admission import AdmissionController
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.prompt_budget import prompt_cpu_budget
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    CompletionLogProbs,
    OpenAIBaseModel,
    StreamOptions,
    UsageInfo,
    random_uuid,
)
from pagedllm.entrypoints.openai.request_log import UnknownFieldReporter, for_log
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.unbuilt_fields import refuse_unbuilt_fields
from pagedllm.outputs import Logprob, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger("pagedllm.entrypoints.openai")

SSE_DONE = "data: [DONE]\n\n"
R = TypeVar("R")
# JSON has no -inf; OpenAI and vLLM clamp impossible tokens' logprobs to this.
MIN_LOGPROB = -9999.0


# Request fields an engine-side ValueError may name first.
_SAMPLING_FIELDS = frozenset({"stop_token_ids", "logit_bias", "logprobs", "prompt_logprobs", "min_tokens", "max_tokens",
                              "allowed_token_ids", "bad_words", "truncate_prompt_tokens"})


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def error_to_api_error(e: BaseException) -> APIError:
    """Errors raised while a request runs -> the status a client should see."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(str(e))
    if isinstance(e, EngineDeadError):
        return APIError(str(e), HTTPStatus.INTERNAL_SERVER_ERROR, code="engine_dead")
    return APIError(f"Internal server error: {type(e).__name__}: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)


def sse_error(e: BaseException) -> str:
    return sse(error_to_api_error(e).to_response())


@dataclass
class EventStream:
    """A streaming answer: SSE events, and the engine requests behind them. The HTTP layer calls
    close() when the response ends for any reason (even before the first event was pulled), so a
    client that leaves early never leaves its requests running."""

    events: AsyncIterator[str]
    request_streams: list[RequestOutputStream]
    # Run once on close, after the aborts (e.g. giving the request's admission back).
    on_close: list[Callable[[], None]] = field(default_factory=list)
    closed: bool = False

    def close(self) -> None:
        for s in self.request_streams:
            s.abort()
        if not self.closed:
            self.closed = True
            for cb in self.on_close:
                cb()


async def merge_streams(streams: list[RequestOutputStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the stream's position.

    Every stream is aborted when the consumer stops early (exception, cancellation, aclose).
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    # Bounded: a pump waits while the consumer is behind; its collector merges deltas meanwhile.
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, s: RequestOutputStream) -> None:
        try:
            async for out in s:
                await q.put((i, out))
            await q.put((i, None))
        except Exception as e:
            await q.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


def clamp_logprob(lp: float) -> float:
    return lp if math.isfinite(lp) and lp > MIN_LOGPROB else MIN_LOGPROB


class OpenAIServing:
    # Server-wide options from vLLM's flags; api_server.build_app sets them on each serving object.
    response_role: str = "assistant"  # --response-role
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids
    force_include_usage: bool = False  # --enable-force-include-usage
    max_log_len: int | None = None  # --max-log-len

    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        *,
        log_requests: bool = True,
        limits: ServerLimits | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.default_sampling_params = engine.processor.default_sampling_params()
        self.log_requests = log_requests
        self.limits = limits or ServerLimits(max_logprobs=engine.config.max_logprobs, max_model_len=self.max_model_len)
        sc = engine.config.scheduler_config
        # Without a server-wide controller (unit use), admit up to one running batch plus a queue.
        self.admission = admission or AdmissionController(sc.max_num_seqs, 1024)
        # The server replaces these with its shared reporter and --max-log-len.
        self.unknown_fields = UnknownFieldReporter(log_enabled=log_requests)
        self.max_log_len: int | None = self.unknown_fields.max_log_len

    def budgeted(self, fn: Callable[..., R], param: str) -> Callable[..., R]:
        """fn under --max-prompt-cpu-seconds, for the tokenizer pool (prompt_budget.py)."""
        seconds = self.limits.max_prompt_cpu_seconds

        def run(*args: Any, **kwargs: Any) -> R:
            with prompt_cpu_budget(seconds, param):
                return fn(*args, **kwargs)

        return run

    async def run_admitted(self, num_seqs: int, work: Callable[[], Awaitable[R]]) -> R:
        """Admit (503 when full, before any tokenization), then run `work`; the admission is held
        until a non-stream answer is built, or until a stream closes however it ends."""
        ticket = self.admission.admit(num_seqs)
        try:
            result = await work()
        except BaseException:
            ticket.release()
            raise
        if isinstance(result, EventStream):
            result.on_close.append(ticket.release)
        else:
            ticket.release()
        return result

    @staticmethod
    def engine_request_id(response_id: str, client_given: bool) -> str:
        """The engine's id for a request answered as `response_id`. A client's own request_id gets a random
        suffix, as vLLM (0.14 on) adds one: two requests of one id (a retry, a proxy's id) run side by side,
        where the second was refused as "already in use". The answer keeps the client's id."""
        return f"{response_id}-{random_uuid()[:8]}" if client_given else response_id

    # -- request checks ----------------------------------------------------------------------------
    def check_engine(self) -> None:
        if self.engine.errored:
            raise APIError(str(self.engine.dead_error), HTTPStatus.SERVICE_UNAVAILABLE, code="engine_dead")

    @staticmethod
    def check_common(request: Any) -> None:
        if request.stream_options is not None and not request.stream:
            raise APIError("stream_options is only allowed when stream is true.", param="stream_options")
        if request.use_beam_search:
            raise APIError("use_beam_search is not supported.", param="use_beam_search")
        if request.stream and request.prompt_logprobs is not None:
            # vLLM's rule and message: they come with the whole answer only
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        refuse_unbuilt_fields(request)

    @staticmethod
    def prompt_logprobs_json(out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """RequestOutput.prompt_logprobs as vLLM's responses carry them: per prompt token None (the first)
        or {token id: {"logprob", "rank", "decoded_token"}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": lp.decoded_token} for t, lp in e.items()}
                for e in out.prompt_logprobs]

    def require_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("This server runs without a tokenizer (skip_tokenizer_init); send token ids.")
        return self.tokenizer

    def log_unknown_fields(self, request: OpenAIBaseModel, request_id: str) -> None:
        self.unknown_fields.report(request_id, request.model_extra or ())

    def log_request(
        self, request_id: str, num_prompt_tokens: int, params: SamplingParams, prompt: Any = None
    ) -> None:
        """With --enable-log-requests: one line per request; the prompt (text or token ids) cut to
        --max-log-len characters / ids, as vLLM logs it."""
        if self.log_requests:
            shown = prompt
            if self.max_log_len is not None and shown is not None:
                shown = shown[: self.max_log_len]
            logger.info(
                "received request %s: %d prompt tokens, n=%d, max_tokens=%s, temperature=%s, stream=%s, prompt=%s",
                for_log(request_id, self.max_log_len), num_prompt_tokens, params.n, params.max_tokens,
                params.temperature, params.output_kind.name, for_log(repr(shown), None),
            )

    def sampling_params(self, request: Any) -> SamplingParams:
        try:
            return request.to_sampling_params(self.default_sampling_params)
        except ValueError as e:
            # SamplingParams' messages start with the field: "temperature must be ..." -> param
            # ("structured_outputs.json_object must be ..." -> structured_outputs).
            msg = str(e)
            first = re.split(r"[ .=\[]", msg, maxsplit=1)[0]
            param = first if first in type(request).model_fields else None
            if getattr(request, "max_completion_tokens", None) is not None and "max_tokens" in msg:
                # The chat request set max_completion_tokens (SamplingParams calls it max_tokens).
                msg = msg.replace("max_tokens", "max_completion_tokens")
                param = "max_completion_tokens" if param in (None, "max_tokens") else param
            raise APIError(msg, param=param) from None

    async def add_request(
        self,
        request_id: str,
        prompt: dict[str, Any],
        params: SamplingParams,
        arrival_time: float,
        prompt_param: str = "prompt",
        constraint: tuple[str, str] | None = None,
    ) -> RequestOutputStream:
        """`constraint`: (param, name) of the request field that set params.structured_outputs
        (structured_fields.constraint_field), so a grammar that does not compile names what was sent."""
        try:
            return await self.engine.add_request(request_id, prompt, params, arrival_time)
        except ValueError as e:
            # The engine's messages start with what is wrong: "stop_token_ids contains 49152, ...",
            # "prompt token id 999999 is ...", "This model's maximum context length is ...".
            msg = str(e)
            code, param = None, None
            first = msg.split(" ", 1)[0].split("=", 1)[0]
            if first in _SAMPLING_FIELDS:  # before "prompt": prompt_logprobs is a sampling field
                param = first
            elif "maximum context length" in msg:
                code, param = "context_length_exceeded", prompt_param
            elif msg.startswith(("prompt", "the prompt")):  # "the prompt is empty; ..."
                param = prompt_param
            elif msg.startswith("request id"):  # "request id 'cmpl-x' is already in use."
                param = "request_id"
            elif constraint is not None:
                # Nothing else claims it, and the request is constrained: the grammar's own check
                # ("structured_outputs.regex cannot be compiled: ...", "JSON schema keyword ...", or a
                # backend's bare message).
                param, name = constraint
                if not msg.startswith(name):
                    renamed = re.sub(r"^structured_outputs\.\w+ ", f"{name} ", msg)
                    msg = renamed if renamed != msg else f"{name}: {msg}"
            raise APIError(msg, param=param, code=code) from None
        except EngineDeadError as e:
            raise APIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE, code="engine_dead") from None

    # -- output formatting -------------------------------------------------------------------------
    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> UsageInfo:
        """OpenAI's usage; prompt_tokens_details.cached_tokens counts prompt tokens served from
        the prefix cache (as OpenAI reports it, and vLLM with --enable-prompt-tokens-details)."""
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached_tokens},
        )

    def stream_usage_flags(self, stream_options: StreamOptions | None) -> tuple[bool, bool]:
        """(a final usage chunk, usage on every chunk); --enable-force-include-usage forces the first."""
        if stream_options is None:
            return self.force_include_usage, False
        include = bool(stream_options.include_usage) or self.force_include_usage
        return include, include and bool(stream_options.continuous_usage_stats)

    def tokens_as_ids(self, request: Any) -> bool:
        """vLLM's return_tokens_as_token_ids: the request's value, else --return-tokens-as-token-ids."""
        asked = getattr(request, "return_tokens_as_token_ids", None)
        return self.return_tokens_as_token_ids if asked is None else asked

    def token_str(self, token_id: int, lp: Logprob | None, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"  # vLLM's spelling, for tokens that are not valid text alone
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, as_ids: bool = False
    ) -> ChatCompletionLogProbs:
        """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        content = []
        for tid, entry in zip(token_ids, logprobs, strict=True):
            sampled = entry.get(tid)
            tok = self.token_str(tid, sampled, as_ids)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            content.append(
                ChatCompletionLogProbsContent(
                    token=tok,
                    logprob=clamp_logprob(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                    bytes=list(tok.encode("utf-8", errors="replace")),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(s := self.token_str(t, lp, as_ids)),
                            logprob=clamp_logprob(lp.logprob),
                            bytes=list(s.encode("utf-8", errors="replace")),
                        )
                        for t, lp in ranked
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)

    def completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int, initial_text_offset: int,
        as_ids: bool = False,
    ) -> CompletionLogProbs:
        """The legacy completions shape: parallel lists tokens / token_logprobs / top_logprobs /
        text_offset (character offset of each token in the choice's text)."""
        out = CompletionLogProbs()
        offset = initial_text_offset
        for tid, entry in zip(token_ids, logprobs, strict=True):
            sampled = entry.get(tid)
            tok = self.token_str(tid, sampled, as_ids)
            out.tokens.append(tok)
            out.token_logprobs.append(clamp_logprob(sampled.logprob) if sampled is not None else MIN_LOGPROB)
            out.text_offset.append(offset)
            offset += len(tok)
            ranked = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:top_n]
            top = {self.token_str(t, lp, as_ids): clamp_logprob(lp.logprob) for t, lp in ranked}
            if sampled is not None:
                top.setdefault(tok, clamp_logprob(sampled.logprob))  # vLLM: the sampled token is always listed
            out.top_logprobs.append(top)
        return out
