"""POST /tokenize and /detokenize (vLLM's endpoints): the server's own tokenizer and chat template."""

from __future__ import annotations

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.chat_utils import check_chat_template_kwargs, check_tools, normalize_messages, render_chat
from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.limits import ServerLimits
from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels


class OpenAIServingTokenization(OpenAIServing):
    def __init__(
        self,
        engine: AsyncLLM,
        models: OpenAIServingModels,
        *,
        chat_template: str | None = None,
        trust_request_chat_template: bool = False,
        limits: ServerLimits | None = None,
    ) -> None:
        super().__init__(engine, models, log_requests=False, limits=limits)
        self.chat_template = chat_template
        self.trust_request_chat_template = trust_request_chat_template

    async def create_tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.models.resolve(request.model)
        tokenizer = self.require_tokenizer()
        self.log_unknown_fields(request, "tokenize")
        if isinstance(request, TokenizeChatRequest) and request.chat_template is not None:
            if not self.trust_request_chat_template:
                raise APIError(
                    "A chat_template in the request is refused; start the server with "
                    "--trust-request-chat-template to allow it.",
                    param="chat_template",
                )

        if isinstance(request, TokenizeChatRequest):
            try:
                check_chat_template_kwargs(request.chat_template_kwargs)
            except ValueError as e:
                raise APIError(str(e), param="chat_template_kwargs") from None
            try:
                check_tools(request.tools)
            except ValueError as e:
                raise APIError(str(e), param="tools") from None
            try:
                messages = normalize_messages(request.messages)
            except ValueError as e:
                raise APIError(str(e), param="messages") from None
            self.limits.check_prompt_bytes(sum(len(m["content"].encode()) for m in messages), "messages")
        else:
            self.limits.check_prompt_bytes(len(request.prompt.encode()), "prompt")

        def work() -> list[int]:
            if isinstance(request, TokenizeChatRequest):
                kwargs = dict(request.chat_template_kwargs or {})
                if request.continue_final_message:
                    kwargs["continue_final_message"] = True
                text = render_chat(
                    tokenizer, request.messages, request.chat_template or self.chat_template,
                    request.add_generation_prompt, kwargs, tools=request.tools,
                )
                self.limits.check_prompt_bytes(len(text.encode()), "messages")  # the whole rendered input
            else:
                text = request.prompt
            return tokenizer.encode(text, add_special_tokens=request.add_special_tokens)

        try:
            ids = await self.engine.run_in_tokenizer_pool(
                self.budgeted(work, "messages" if isinstance(request, TokenizeChatRequest) else "prompt")
            )
        except APIError:
            raise  # the CPU budget, the prompt's size
        except Exception as e:  # noqa: BLE001 - a chat template may raise anything ({{ 1/0 }}): a 400
            chat = isinstance(request, TokenizeChatRequest)
            param = ("chat_template" if request.chat_template is not None else "messages") if chat else "prompt"
            raise APIError(f"{type(e).__name__}: {e}" if chat else str(e), param=param) from None
        token_strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.models.resolve(request.model)
        tokenizer = self.require_tokenizer()
        self.unknown_fields.report("detokenize", request.model_extra or ())
        vocab = self.engine.model_config.vocab_size
        for t in request.tokens:
            if not 0 <= t < vocab:
                raise APIError(f"token id {t} is outside the vocabulary [0, {vocab}).", param="tokens")
        text = await self.engine.run_in_tokenizer_pool(tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)
