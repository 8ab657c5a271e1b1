"""POST /v1/chat/completions: messages -> chat template -> tokens -> engine -> OpenAI's chat shapes.

A stream starts with one chunk per choice carrying `role: "assistant"` (and `content: ""`), then
content deltas, the last delta of each choice carrying its finish_reason; with
`stream_options.include_usage` a final chunk has `choices: []` and the usage; then `data: [DONE]`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.output_stream import RequestOutputStream
from pagedllm.entrypoints.chat_utils import check_chat_template_kwargs, check_tools, normalize_messages, render_chat
from pagedllm.entrypoints.openai.admission import AdmissionController
from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser, required_tools_schema
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
from pagedllm.entrypoints.openai.structured_fields import constraint_field
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, get_tool_parser
from pagedllm.reasoning import ReasoningParser, get_reasoning_parser
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode  # pydantic's JSON text


def chat_chunk_head(request_id: str, created: int, model: str) -> str:
    """The part of every chunk of one chat stream before its choices (ChatCompletionStreamResponse's)."""
    return f'data: {{"id":{_dumps(request_id)},"object":"chat.completion.chunk","created":{int(created)},' \
           f'"model":{_dumps(model)},"choices":['


def chat_content_chunk(head: str, index: int, content: str) -> str:
    """sse(ChatCompletionStreamResponse(choices=[ChatCompletionResponseStreamChoice(index=index,
    delta=DeltaMessage(content=content))])) character for character, without the three models and the
    delta's serializer (a stream writes one per step): the chunk of plain text, no role, reasoning, tool
    call, logprobs, finish, token ids or usage."""
    return f'{head}{{"index":{index},"delta":{{"role":null,"content":{_dumps(content)}}}{_CONTENT_TAIL}'


_CONTENT_TAIL = ',"logprobs":null,"finish_reason":null,"stop_reason":null,"token_ids":null}],"usage":null,' \
    '"system_fingerprint":null,"prompt_token_ids":null}\n\n'



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
        enable_auto_tools: bool = False,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        super().__init__(engine, models, log_requests=log_requests, limits=limits, admission=admission)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser_cls: type[ToolParser] | None = get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning_parser: ReasoningParser | None = None
        if reasoning_parser:
            if self.tokenizer is None:
                raise ValueError("--reasoning-parser needs a tokenizer.")
            self.reasoning_parser = get_reasoning_parser(reasoning_parser)(self.tokenizer)

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
        tool_mode, named = self._tool_mode(request)
        params = self.sampling_params(request)
        self._constrain_tools(request, params, tool_mode, named)
        self.limits.check_max_tokens(params.max_tokens, "max_completion_tokens" if request.max_completion_tokens
                                     is not None else "max_tokens")
        self.require_tokenizer()
        try:
            messages = normalize_messages(request.messages)
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        self.limits.check_prompt_bytes(sum(len(m["content"].encode()) for m in messages), "messages")
        return await self.run_admitted(
            params.n, lambda: self._generate(request, request_id, model_name, params, arrival_time, tool_mode, named)
        )

    async def _generate(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        model_name: str,
        params: SamplingParams,
        arrival_time: float,
        tool_mode: str = "none",
        named: str | None = None,
    ) -> ChatCompletionResponse | EventStream:
        try:
            prompt_text, prompt_ids, echo_text = await self.engine.run_in_tokenizer_pool(
                self.budgeted(self._render, "messages"), request
            )
        except APIError:
            raise  # the CPU budget, the prompt's size
        except Exception as e:  # noqa: BLE001 - a template may raise anything ({{ 1/0 }}, range(10**9)): a 400
            param = "chat_template" if request.chat_template is not None else "messages"
            raise APIError(f"Cannot apply the chat template to these messages: {type(e).__name__}: {e}",
                           param=param) from None
        thinking = self._thinking(request, prompt_text)
        if thinking and params.structured_outputs is not None:
            # The grammar starts after the thinking text (request.py).
            params.structured_outputs._reasoning_end_token_ids = [self.reasoning_parser.end_token_id]
        make_parser = lambda: ChoiceOutputParser(  # noqa: E731 - one per choice
            self.reasoning_parser if thinking else None,
            tool_mode,
            self.tool_parser_cls(self.tokenizer) if tool_mode == "auto" else None,
            named,
        )
        engine_id = self.engine_request_id(request_id, bool(request.request_id))
        self.log_request(engine_id, len(prompt_ids), params, prompt_text)
        stream = await self.add_request(
            engine_id,
            {"prompt": prompt_text, "prompt_token_ids": prompt_ids, "cache_salt": request.cache_salt},
            params,
            arrival_time,
            "messages",
            constraint_field(request, tool_mode),
        )
        if request.stream:
            events = self._stream(request, stream, request_id, model_name, prompt_ids, params, echo_text, make_parser)
            return EventStream(events, [stream])
        return await self._full(stream, request_id, model_name, params, echo_text, bool(request.return_token_ids),
                                make_parser, self.tokens_as_ids(request), request.include_reasoning)

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
        try:
            check_chat_template_kwargs(request.chat_template_kwargs)
        except ValueError as e:
            raise APIError(str(e), param="chat_template_kwargs") from None

    def _tool_mode(self, request: ChatCompletionRequest) -> tuple[str, str | None]:
        """Check tools / tool_choice; -> ("none" | "auto" | "required" | "named", the named function)."""
        try:
            names = check_tools(request.tools)
        except ValueError as e:
            raise APIError(str(e), param="tools") from None
        choice = request.tool_choice
        if choice is None:
            choice = "auto" if names else "none"
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise APIError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                               '"function": {"name": ...}}.', param="tool_choice")
            if name not in names:
                raise APIError(f"tool_choice names function {name!r}, which is not in tools "
                               f"({', '.join(names) or 'none given'}).", param="tool_choice")
            return "named", name
        if choice not in ("none", "auto", "required"):
            raise APIError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}.',
                           param="tool_choice")
        if choice != "none" and not names:
            raise APIError(f'tool_choice "{choice}" needs tools.', param="tool_choice")
        if choice == "auto" and not (self.enable_auto_tools and self.tool_parser_cls is not None):
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set.',
                           param="tool_choice")
        return choice, None

    def _constrain_tools(self, request: ChatCompletionRequest, params: SamplingParams, mode: str,
                         named: str | None) -> None:
        """required / named tool choice: a grammar makes the output valid calls (vLLM's schemas)."""
        if mode == "auto" and self.tool_parser_cls is not None and self.tool_parser_cls.needs_special_tokens:
            params.skip_special_tokens = False  # the parser reads the call marker
        if mode not in ("required", "named"):
            return
        if params.structured_outputs is not None:
            raise APIError(f'tool_choice "{mode}" and response_format / structured outputs both constrain the '
                           "output; give one.", param="tool_choice")
        tools = request.tools or []
        if mode == "required":
            schema = required_tools_schema(tools, request.parallel_tool_calls is not False)
        else:
            fn = next(t["function"] for t in tools if t["function"]["name"] == named)
            schema = fn.get("parameters") or {"type": "object"}
        params.structured_outputs = StructuredOutputsParams(json=schema)

    def _thinking(self, request: ChatCompletionRequest, prompt_text: str) -> bool:
        """Whether this answer starts with thinking text (a reasoning parser is set and the prompt
        did not already close the think block, as enable_thinking=false templates do)."""
        if self.reasoning_parser is None:
            return False
        if (request.chat_template_kwargs or {}).get("enable_thinking") is False:
            return False
        return not self.reasoning_parser.reasoning_ended_in_prompt(prompt_text)

    def _render(self, request: ChatCompletionRequest) -> tuple[str, list[int], str]:
        """Runs in the tokenizer pool: (prompt text, prompt token ids, text to echo)."""
        tokenizer = self.tokenizer
        messages = normalize_messages(request.messages)
        kwargs: dict[str, Any] = dict(request.chat_template_kwargs or {})
        if request.continue_final_message:
            kwargs["continue_final_message"] = True
        if request.reasoning_effort is not None:
            kwargs["reasoning_effort"] = request.reasoning_effort  # vLLM's: over chat_template_kwargs' own
        text = render_chat(
            tokenizer, messages, request.chat_template or self.chat_template, request.add_generation_prompt, kwargs,
            tools=request.tools, documents=request.documents,
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
        make_parser=None,
        as_ids: bool = False,
        include_reasoning: bool = True,
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
                self.chat_logprobs(c.token_ids, c.logprobs, params.logprobs, as_ids)
                if params.logprobs is not None and c.logprobs is not None
                else None
            )
            parser = make_parser() if make_parser is not None else ChoiceOutputParser(None, "none")
            parser.feed(c.text, final=True)
            reasoning, content, tool_calls = parser.message()
            if not include_reasoning:
                reasoning = None  # vLLM's include_reasoning=false: the thinking is parsed out, then left out
            if echo_text:
                content = echo_text + (content or "")
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=ChatMessage(role=self.response_role, content=content, reasoning_content=reasoning,
                                        tool_calls=tool_calls),
                    logprobs=logprobs,
                    finish_reason=parser.finish_reason(c.finish_reason),
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
            prompt_logprobs=self.prompt_logprobs_json(final),
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
        make_parser=None,
    ) -> AsyncIterator[str]:
        created = int(time.time())
        parsers = [make_parser() if make_parser is not None else ChoiceOutputParser(None, "none")
                   for _ in range(params.n)]
        include_usage, continuous_usage = self.stream_usage_flags(request.stream_options)
        return_token_ids = bool(request.return_token_ids)
        as_ids = self.tokens_as_ids(request)
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

        head = chat_chunk_head(request_id, created, model_name)

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
                    parser = parsers[c.index]
                    reasoning, content, tool_deltas = parser.feed(c.text, final=c.finish_reason is not None)
                    if not request.include_reasoning:
                        reasoning = ""
                    shown = reasoning or content or tool_deltas
                    if not shown and c.finish_reason is None and not c.logprobs and not return_token_ids:
                        continue  # nothing to show yet (half a multibyte character, a tool call in progress)
                    finish_reason = parser.finish_reason(c.finish_reason)
                    if (content and not reasoning and not tool_deltas and c.logprobs is None and finish_reason is None
                            and c.stop_reason is None and not return_token_ids and not continuous_usage):
                        yield chat_content_chunk(head, c.index, content)  # the common chunk: text only
                        continue
                    logprobs = (
                        self.chat_logprobs(c.token_ids, c.logprobs, params.logprobs, as_ids)
                        if params.logprobs is not None and c.logprobs is not None
                        else None
                    )
                    yield chunk(
                        ChatCompletionResponseStreamChoice(
                            index=c.index,
                            delta=DeltaMessage(content=content if content or not shown else None,
                                               reasoning_content=reasoning or None, tool_calls=tool_deltas or None),
                            logprobs=logprobs,
                            finish_reason=finish_reason,
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
