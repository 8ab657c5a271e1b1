"""Request and response bodies of the OpenAI-compatible server (pydantic), with vLLM's extra fields.

Requests are validated strictly from the raw JSON (`Model.model_validate_json(body)`): `"max_tokens":
"100"`, `1.5` or `true` are type errors (400), not silently coerced. Fields OpenAI or vLLM define but
this server ignores, and unknown fields, are kept in `model_extra` so the server can log them.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from pagedllm.entrypoints.openai.structured_fields import structured_outputs_from_request
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# Fields that mean "use the model's default" when left out; filled from generation_config, then
# from SamplingParams' own defaults (vLLM's order).
_DEFAULTABLE = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def random_uuid() -> str:
    return secrets.token_hex(16)


class OpenAIBaseModel(BaseModel):
    # strict: JSON types must match (no "100" -> 100); extra: unknown fields are kept, then logged.
    model_config = ConfigDict(strict=True, extra="allow")


class StrictResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- errors -------------------------------------------------------------------------------------------
class ErrorInfo(StrictResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(StrictResponseModel):
    error: ErrorInfo


# -- shared pieces ----------------------------------------------------------------------------------
class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    # vLLM: usage on every chunk, not only the last one.
    continuous_usage_stats: bool | None = False


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, int] | None = None


class ModelPermission(BaseModel):
    id: str = Field(default_factory=lambda: f"modelperm-{random_uuid()}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class _SamplingRequest(OpenAIBaseModel):
    """Fields chat and completions share: OpenAI's sampling fields plus vLLM's extra body fields."""

    model: str | None = None
    n: int | None = 1
    best_of: int | None = None
    # torch generators take 64-bit seeds; vLLM bounds the field the same way.
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extra sampling parameters.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    # vLLM: also return the prompt's and each choice's token ids.
    return_token_ids: bool | None = False
    # vLLM: logprobs name tokens "token_id:N"; None: --return-tokens-as-token-ids decides.
    return_tokens_as_token_ids: bool | None = None
    use_beam_search: bool = False  # vLLM's field; refused when true (beam search is not built)
    # Constrained output (structured_fields.py reads these with response_format).
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # keep only the last k prompt tokens; -1: as many as the context allows
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)

    def _sampling_kwargs(self, default: SamplingParams) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "n": self.n if self.n is not None else 1,
            "best_of": self.best_of,
            "seed": self.seed,
            "stop": self.stop,
            "frequency_penalty": self.frequency_penalty if self.frequency_penalty is not None else 0.0,
            "presence_penalty": self.presence_penalty if self.presence_penalty is not None else 0.0,
            "logit_bias": dict(self.logit_bias) if self.logit_bias else None,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "prompt_logprobs": self.prompt_logprobs,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "output_kind": RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            "structured_outputs": structured_outputs_from_request(self),
        }
        for name in _DEFAULTABLE:
            v = getattr(self, name)
            kwargs[name] = v if v is not None else getattr(default, name)
        return kwargs


# -- chat ---------------------------------------------------------------------------------------------
class ChatCompletionRequest(_SamplingRequest):
    # Messages are checked (roles, content parts) by chat_utils.normalize_messages, which names the
    # offending message in its error.
    messages: list[Any]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = Field(default=None, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's chat extras.
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: false leaves the thinking text (reasoning_content) out of the answer.
    include_reasoning: bool = True
    # OpenAI's; vLLM gives it to the chat template (templates that read it: how long to think).
    reasoning_effort: str | None = None
    # vLLM's RAG documents ({"title", "text"} each), for templates that show them.
    documents: list[dict[str, str]] | None = None
    # Tool calling (serving_chat checks them: tool_choice "none" | "auto" | "required" | a named function).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, default: SamplingParams) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is set but logprobs is not true; set logprobs=true to get logprobs.")
        kwargs = self._sampling_kwargs(default)
        kwargs["max_tokens"] = self.max_new_tokens()
        kwargs["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**kwargs)


class ChatMessage(BaseModel):
    role: str
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_unused(self, handler: Any) -> dict[str, Any]:
        # A delta without thinking text or tool calls reads as before: {"role", "content"} only.
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{random_uuid()}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, with the prompt_logprobs field


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this delta's tokens


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids, on the first chunk


# -- completions ----------------------------------------------------------------------------------------
class CompletionRequest(_SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None

    def to_sampling_params(self, default: SamplingParams) -> SamplingParams:
        kwargs = self._sampling_kwargs(default)
        kwargs["max_tokens"] = self.max_tokens
        kwargs["logprobs"] = self.logprobs
        return SamplingParams(**kwargs)


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # with return_token_ids (prompt_token_ids only on a choice's first chunk when streaming)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponseFullChoice(CompletionResponseChoice):
    """A whole (not streamed) answer's choice: vLLM's prompt_logprobs too (None for the first prompt token,
    then {token id: {logprob, rank, decoded_token}}), with the prompt_logprobs field."""

    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{random_uuid()}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseFullChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class CompletionResponseStreamChoice(CompletionResponseChoice):
    """A streamed choice: a full choice's fields, in its order; text is this chunk's delta."""


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- tokenizer endpoints ------------------------------------------------------------------------------
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: str | None = None
    messages: list[Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the template shows them, so the count is the chat prompt's (was an unknown field, left out).
    tools: list[dict[str, Any]] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
