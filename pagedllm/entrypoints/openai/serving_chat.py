"""POST /v1/chat/completions: messages -> chat template -> tokens -> engine -> OpenAI's chat shapes.

A stream starts with one chunk per choice carrying `role: "assistant"` (and `content: ""`), then
content deltas, the last delta of each choice carrying its finish_reason; with
`stream_options.include_usage` a final chunk has `choices: []` and the usage; then `data: [DONE]`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import jinja2

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_stream import RequestOutputStream
from pagedllm.entrypoints.chat_utils import normalize_messages, render_chat
from pagedllm.entrypoints.openai.admission import AdmissionController
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import SSE_DONE, EventStream, OpenAIServing, sse, sse_error
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.sampling_params import SamplingParams

# apply_chat_template arguments a request may not set through chat_template_kwargs: they would
# change what rendering returns (token ids, tensors, dicts) instead of the template's variables.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "add_generation_prompt", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools", "documents"}
)


class OpenAIServingChat(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        *,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        log_requests: bool = True,
        limits: ServerLimits | None = None,
        admission: AdmissionController | None = None,
    ) -> None:
        super().__init__(engine, models, log_requests=log_requests, limits=limits, admission=admission)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template

    async def create_chat_completion(
        self, request: ChatCompletionRequest, arrival_time: float | None = None
    ) -> ChatCompletionResponse | EventStream:
        """A full response, or (stream=true) the SSE events. Raises APIError before any work is
        queued when the request is invalid, and 503 (before tokenization) when the server is full."""
        arrival_time = arrival_time or time.time()
        model_name = self.models.resolve(request.model)
        self.check_engine()
        request_id = f"chatcmpl-{request.request_id or random_uuid()}"
        self.log_unknown_fields(request, request_id)
        self._check_supported(request)
        self.check_common(request)
        self.limits.check_sampling(request, logprobs_field="top_logprobs")
        params = self.sampling_params(request)
        self.limits.check_max_tokens(params.max_tokens, "max_completion_tokens" if request.max_completion_tokens
                                     is not None else "max_tokens")
        self.require_tokenizer()
        try:
            messages = normalize_messages(request.messages)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        self.limits.check_prompt_bytes(sum(len(m["content"].encode()) for m in messages), "messages")
        return await self.run_admitted(
            params.n, lambda: self._generate(request, request_id, model_name, params, arrival_time)
        )

    async def _generate(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        params: SamplingParams,
        arrival_time: float,
    ) -> ChatCompletionResponse | EventStream:
        try:
            prompt_text, prompt_ids, echo_text = await self.engine.run_in_tokenizer_pool(
                self.budgeted(self._render, "messages"), request
            )
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise APIError(f"Cannot apply the chat template to these messages: {e}") from None
        self.log_request(request_id, len(prompt_ids), params, prompt_text)
        stream = await self.add_request(
            request_id,
            {"prompt": prompt_text, "prompt_token_ids": prompt_ids, "cache_salt": request.cache_salt},
            params,
            arrival_time,
            "messages",
        )
        if request.stream:
            events = self._stream(request, stream, request_id, model_name, prompt_ids, params, echo_text)
            return EventStream(events, [stream])
        return await self._full(stream, request_id, model_name, params, echo_text, bool(request.return_token_ids))

    # -- input -------------------------------------------------------------------------------------
    def _check_supported(self, request: ChatCompletionRequest) -> None:
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise APIError(
                "A chat_template in the request is refused; start the server with --trust-request-chat-template "
                "to allow it.",
                param="chat_template",
            )
        if request.add_generation_prompt and request.continue_final_message:
            raise APIError(
                "add_generation_prompt and continue_final_message cannot both be true; set add_generation_prompt"
                " to false to continue the final message.",
                param="continue_final_message",
            )
        fmt = request.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            raise APIError(
                f"response_format type {fmt.get('type')!r} is not supported; only 'text' is.", param="response_format"
            )
        if request.chat_template_kwargs:
            bad = sorted(set(request.chat_template_kwargs) & _RESERVED_TEMPLATE_KWARGS)
            if bad:
                raise APIError(
                    f"chat_template_kwargs may not set {', '.join(bad)}.", param="chat_template_kwargs"
                )

    def _render(self, request: ChatCompletionRequest) -> tuple[str, list[int], str]:
        """Runs in the tokenizer pool: (prompt text, prompt token ids, text to echo)."""
        tokenizer = self.tokenizer
        messages = normalize_messages(request.messages)
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        text = render_chat(
            tokenizer, messages, request.chat_template or self.chat_template, request.add_generation_prompt, kwargs
        )
        self.limits.check_prompt_bytes(len(text.encode()), "messages")  # the whole rendered input
        ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        # vLLM's echo: the last message is repeated at the start of the answer when it is the
        # assistant's own (a continuation).
        echo = messages[-1]["content"] if request.echo and messages[-1]["role"] == "assistant" else ""
        return text, ids, echo

    # -- output ------------------------------------------------------------------------------------
    async def _full(
        self,
        stream: RequestOutputStream,
        request_id: str,
        model_name: str,
        params: SamplingParams,
        echo_text: str,
        return_token_ids: bool,
    ) -> ChatCompletionResponse:
        created = int(time.time())
        final = None
        try:
            async for out in stream:
                final = out
        except ValueError as e:  # refused by the engine core after queueing
            raise APIError(str(e)) from None
        finally:
            stream.abort()
        assert final is not None and final.finished
        choices = []
        num_generated = 0
        for c in final.outputs:
            num_generated += len(c.token_ids)
            logprobs = (
                self.chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
                if params.logprobs is not None and c.logprobs is not None
                else None
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatMessage(role=self.response_role, content=echo_text + c.text),
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=list(c.token_ids) if return_token_ids else None,
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model_name,
            choices=choices,
            usage=self.usage(len(final.prompt_token_ids), num_generated, final.num_cached_tokens),
            prompt_token_ids=list(final.prompt_token_ids) if return_token_ids else None,
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        stream: RequestOutputStream,
        request_id: str,
        model_name: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        echo_text: str,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage, continuous_usage = self.stream_usage_flags(request.stream_options)
        return_token_ids = bool(request.return_token_ids)
        completion_tokens = [0] * params.n
        cached_tokens = 0

        def chunk(choice: ChatCompletionResponseStreamChoice | None, first: bool = False) -> str:
            usage = None
            if continuous_usage or choice is None:
                usage = self.usage(len(prompt_token_ids), sum(completion_tokens), cached_tokens)
            return sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=model_name, choices=[choice] if choice else [], usage=usage,
                    prompt_token_ids=prompt_token_ids if first and return_token_ids else None,
                )
            )

        try:
            for i in range(params.n):
                yield chunk(
                    ChatCompletionResponseStreamChoice(
                        index=i, delta=DeltaMessage(role=self.response_role, content=echo_text),
                        token_ids=[] if return_token_ids else None,
                    ),
                    first=True,
                )
            async for out in stream:
                cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens[c.index] += len(c.token_ids)
                    if not c.text and c.finish_reason is None and not c.logprobs and not return_token_ids:
                        continue  # nothing to show yet (e.g. half of a multibyte character)
                    logprobs = (
                        self.chat_logprobs(c.token_ids, c.logprobs, params.logprobs)
                        if params.logprobs is not None and c.logprobs is not None
                        else None
                    )
                    yield chunk(
                        ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=c.text),
                            logprobs=logprobs,
                            finish_reason=c.finish_reason,
                            stop_reason=c.stop_reason,
                            token_ids=list(c.token_ids) if return_token_ids else None,
                        )
                    )
            if include_usage:
                yield chunk(None)
        except Exception as e:  # an engine failure mid-stream: tell the client in-band
            yield sse_error(e)
        finally:
            stream.abort()
        yield SSE_DONE
