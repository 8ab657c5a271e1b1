"""POST /v1/completions: prompt(s) -> tokens -> engine -> OpenAI's (legacy) completion shapes.

`prompt` may be a string, a list of strings, a list of token ids or a list of token-id lists;
with P prompts and n samples each, choice `index` is `prompt_index * n + sample_index` (as OpenAI).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_stream import RequestOutputStream
from pagedllm.entrypoints.openai.admission import AdmissionController
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseFullChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EventStream,
    OpenAIServing,
    merge_streams,
    sse,
    sse_error,
)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.structured_fields import constraint_field
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

TextOrTokens = str | list[int]
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # pydantic's JSON text


def stream_chunk_head(request_id: str, created: int, model: str) -> str:
    """The part of every chunk of one stream before its choices (CompletionStreamResponse's fields)."""
    return f'data: {{"id":{_dumps(request_id)},"object":"text_completion","created":{int(created)},' \
           f'"model":{_dumps(model)},"choices":['


def stream_chunk_json(
    head: str,
    index: int,
    text: str,
    finish_reason: str | None,
    stop_reason: int | str | None,
    prompt_token_ids: list[int] | None,
    token_ids: list[int] | None,
    usage: UsageInfo | None,
) -> str:
    """sse(CompletionStreamResponse(choices=[CompletionResponseStreamChoice(...)], usage=usage)) for a
    choice without logprobs, character for character, without building the models (a stream writes one
    per step or batch of steps). The fields' JSON is joined in the models' order; only the text and the
    token ids need an encoder call, the rest are constants or ints (the common chunk, text only, is
    `head {"index":N,"text":"..."` and a constant tail)."""
    if finish_reason is None and stop_reason is None and prompt_token_ids is None and token_ids is None \
            and usage is None:
        return f'{head}{{"index":{index},"text":{_dumps(text)}{_PLAIN_TAIL}'
    return (
        f'{head}{{"index":{index},"text":{_dumps(text)},"logprobs":null,"finish_reason":{_dumps(finish_reason)},'
        f'"stop_reason":{_dumps(stop_reason)},"prompt_token_ids":{_ids(prompt_token_ids)},'
        f'"token_ids":{_ids(token_ids)}}}],"usage":{_dumps(usage.model_dump()) if usage is not None else "null"}}}\n\n'
    )


_PLAIN_TAIL = ',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,"token_ids":null}],' \
    '"usage":null}\n\n'


def _ids(ids: list[int] | None) -> str:
    return "null" if ids is None else f"[{','.join(map(str, ids))}]"


def normalize_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[TextOrTokens]:
    """[["a"]] forms -> one entry per prompt: "text" or [token ids]."""
    if isinstance(prompt, str):
        prompts: list[TextOrTokens] = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if not prompts:
        raise APIError("prompt is empty; give a string, a list of strings or a list of token ids.", param="prompt")
    for i, p in enumerate(prompts):
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            raise APIError(f"{where} is empty; a prompt needs at least one token.", param="prompt")
    return prompts


class OpenAIServingCompletion(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        *,
        log_requests: bool = True,
        limits: ServerLimits | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        super().__init__(engine, models, log_requests=log_requests, limits=limits, admission=admission)

    async def create_completion(
        self, request: CompletionRequest, arrival_time: float | None = None
    ) -> CompletionResponse | EventStream:
        arrival_time = arrival_time or time.time()
        model_name = self.models.resolve(request.model)
        self.check_engine()
        request_id = f"cmpl-{request.request_id or random_uuid()}"
        self.log_unknown_fields(request, request_id)
        self.check_common(request)
        if request.suffix:
            raise APIError("suffix is not supported.", param="suffix")
        self.limits.check_sampling(request, logprobs_field="logprobs")
        params = self.sampling_params(request)
        if request.echo and request.logprobs is not None:
            # the echoed prompt's tokens get logprobs too (vLLM's; lm-eval's loglikelihood requests): its
            # prompt logprobs, the first token's None
            params.prompt_logprobs = max(params.prompt_logprobs or 0, request.logprobs)
        self.limits.check_max_tokens(params.max_tokens, "max_tokens")
        prompts = normalize_prompts(request.prompt)
        self.limits.check_prompt_bytes(sum(len(p.encode()) for p in prompts if isinstance(p, str)), "prompt")
        for p in prompts:
            if isinstance(p, list) and params.truncate_prompt_tokens is None:  # truncation comes first
                self.limits.check_prompt_token_ids(len(p), params.max_tokens, "prompt")
        return await self.run_admitted(
            len(prompts) * params.n,
            lambda: self._generate(request, prompts, request_id, model_name, params, arrival_time),
        )

    async def _generate(
        self,
        request: CompletionRequest,
        prompts: list[TextOrTokens],
        request_id: str,
        model_name: str,
        params: SamplingParams,
        arrival_time: float,
    ) -> CompletionResponse | EventStream:
        try:
            encoded = await self.engine.run_in_tokenizer_pool(self.budgeted(self._encode, "prompt"), prompts, request)
        except ValueError as e:
            raise APIError(str(e), param="prompt") from None

        streams: list[RequestOutputStream] = []
        engine_id = self.engine_request_id(request_id, bool(request.request_id))
        try:
            for i, (text, ids, _) in enumerate(encoded):
                sub_id = engine_id if len(encoded) == 1 else f"{engine_id}-{i}"
                self.log_request(sub_id, len(ids), params, text if text is not None else ids)
                # cache_salt (vLLM): only requests with the same salt share prefix-cache blocks.
                prompt = {"prompt": text, "prompt_token_ids": ids, "cache_salt": request.cache_salt}
                streams.append(await self.add_request(sub_id, prompt, params, arrival_time,
                                                      constraint=constraint_field(request)))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        echoes = [echo for _, _, echo in encoded] if request.echo else ["" for _ in encoded]
        if request.stream:
            num_prompt_tokens = sum(len(ids) for _, ids, _ in encoded)
            events = self._stream(request, streams, request_id, model_name, num_prompt_tokens, params, echoes)
            return EventStream(events, streams)
        try:
            return await self._full(streams, request_id, model_name, params, echoes, bool(request.return_token_ids),
                                    self.tokens_as_ids(request), request)
        finally:
            for s in streams:
                s.abort()

    def _encode(
        self, prompts: list[TextOrTokens], request: CompletionRequest
    ) -> list[tuple[str | None, list[int], str]]:
        """Runs in the tokenizer pool: (text or None, token ids, text to echo) per prompt."""
        out = []
        for p in prompts:
            if isinstance(p, str):
                tok = self.require_tokenizer()
                out.append((p, tok.encode(p, add_special_tokens=request.add_special_tokens), p))
            else:
                echo = ""
                if request.echo:
                    tok = self.require_tokenizer()
                    self.engine.processor.tokenize_prompt(p)  # out-of-vocabulary ids: ValueError, not garbage
                    echo = tok.decode(p, skip_special_tokens=False)
                out.append((None, p, echo))
        return out

    # -- output ------------------------------------------------------------------------------------
    async def _full(
        self,
        streams: list[RequestOutputStream],
        request_id: str,
        model_name: str,
        params: SamplingParams,
        echoes: list[str],
        return_token_ids: bool,
        as_ids: bool,
        request: CompletionRequest,
    ) -> CompletionResponse:
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge_streams(streams):
                finals[i] = out
        except ValueError as e:  # refused by the engine core after queueing
            raise APIError(str(e)) from None
        choices = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for i in range(len(streams)):
            final = finals[i]
            prompt_tokens += len(final.prompt_token_ids)
            cached_tokens += final.num_cached_tokens
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                choice = CompletionResponseFullChoice(
                    **vars(self._choice(i * params.n + c.index, c, params, echoes[i], 0, as_ids)),
                    prompt_logprobs=self.prompt_logprobs_json(final) if request.prompt_logprobs is not None else None)
                if request.echo and choice.logprobs is not None:
                    choice.logprobs = self._with_echoed(final, choice.logprobs, request.logprobs, as_ids)
                if return_token_ids:
                    choice.prompt_token_ids = list(final.prompt_token_ids)
                    choice.token_ids = list(c.token_ids)
                choices.append(choice)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model_name,
            choices=choices,
            usage=self.usage(prompt_tokens, completion_tokens, cached_tokens),
        )

    def _with_echoed(self, out: RequestOutput, logprobs: CompletionLogProbs, top_n: int,
                     as_ids: bool) -> CompletionLogProbs:
        """The echoed prompt's logprobs (vLLM's shape: its first token None) before the answer's."""
        ids, plp = out.prompt_token_ids, out.prompt_logprobs
        if not ids or plp is None:
            return logprobs
        first = self.token_str(ids[0], None, as_ids)
        echoed = self.completion_logprobs(ids[1:], plp[1:], top_n, len(first), as_ids)
        return CompletionLogProbs(text_offset=[0] + echoed.text_offset + logprobs.text_offset,
                                  token_logprobs=[None] + echoed.token_logprobs + logprobs.token_logprobs,
                                  tokens=[first] + echoed.tokens + logprobs.tokens,
                                  top_logprobs=[None] + echoed.top_logprobs + logprobs.top_logprobs)

    def _choice(
        self, index: int, c: CompletionOutput, params: SamplingParams, prefix: str, text_offset: int,
        as_ids: bool = False,
    ) -> CompletionResponseChoice:
        logprobs = (
            self.completion_logprobs(c.token_ids, c.logprobs, params.logprobs, text_offset + len(prefix), as_ids)
            if params.logprobs is not None and c.logprobs is not None
            else None
        )
        return CompletionResponseChoice(
            index=index, text=prefix + c.text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
        )

    async def _stream(
        self,
        request: CompletionRequest,
        streams: list[RequestOutputStream],
        request_id: str,
        model_name: str,
        num_prompt_tokens: int,
        params: SamplingParams,
        echoes: list[str],
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = self.stream_usage_flags(request.stream_options)
        as_ids = self.tokens_as_ids(request)
        completion_tokens = 0
        cached: dict[int, int] = {}  # prompt index -> tokens served from the prefix cache
        # Per choice index: characters sent so far (for logprobs' text_offset) and whether the
        # echoed prompt went out.
        sent_chars: dict[int, int] = {}

        def chunk(choice: CompletionResponseStreamChoice | None) -> str:
            usage = (
                self.usage(num_prompt_tokens, completion_tokens, sum(cached.values()))
                if continuous_usage or choice is None
                else None
            )
            return sse(
                CompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[choice] if choice else [], usage=usage
                )
            )

        # Chunks without logprobs (one per token per stream) skip the three pydantic models above and
        # are written as the same JSON text directly (stream_chunk_json).
        head = stream_chunk_head(request_id, created, model_name)

        try:
            async for i, out in merge_streams(streams):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    index = i * params.n + c.index
                    completion_tokens += len(c.token_ids)
                    first = index not in sent_chars
                    prefix = echoes[i] if first else ""
                    if not (c.text or prefix or c.finish_reason or c.logprobs or request.return_token_ids):
                        continue
                    if params.logprobs is None:
                        text = prefix + c.text
                        sent_chars[index] = sent_chars.get(index, 0) + len(text)
                        ids = request.return_token_ids
                        usage = (self.usage(num_prompt_tokens, completion_tokens, sum(cached.values()))
                                 if continuous_usage else None)
                        yield stream_chunk_json(
                            head, index, text, c.finish_reason, c.stop_reason,
                            (list(out.prompt_token_ids) if first else None) if ids else None,
                            list(c.token_ids) if ids else None, usage,
                        )
                        continue
                    choice = self._choice(index, c, params, prefix, sent_chars.get(index, 0), as_ids)
                    if first and request.echo and choice.logprobs is not None:
                        choice.logprobs = self._with_echoed(out, choice.logprobs, request.logprobs, as_ids)
                    if request.return_token_ids:
                        choice.prompt_token_ids = list(out.prompt_token_ids) if first else None
                        choice.token_ids = list(c.token_ids)
                    sent_chars[index] = sent_chars.get(index, 0) + len(choice.text)
                    yield chunk(CompletionResponseStreamChoice(**choice.model_dump()))
            if include_usage:
                yield chunk(None)
        except Exception as e:
            yield sse_error(e)
        finally:
            for s in streams:
                s.abort()
        yield SSE_DONE
