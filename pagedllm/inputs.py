"""vLLM's prompt types (vllm.inputs): `LLM.generate(TokensPrompt(prompt_token_ids=[...]))` and the like.

They are plain dicts to the engine (engine/processor.py reads their keys); these TypedDicts give vLLM
scripts their names. A key that is not built (multi_modal_data with data, prompt_embeds, ...) is
refused by the processor, naming it.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict, Union


class TextPrompt(TypedDict):
    prompt: str
    multi_modal_data: NotRequired[Any]  # refused unless None / empty: multimodal inputs are not built
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # the text the ids came from, returned as RequestOutput.prompt
    token_type_ids: NotRequired[list[int]]  # pooling (cross-encoder) models only
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


SingletonPrompt = Union[str, TextPrompt, TokensPrompt]
PromptType = SingletonPrompt

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]
