"""Chat messages -> prompt text through the tokenizer's chat template (shared by LLM.chat and the server).

Content may be a string or OpenAI's list of parts (`[{"type": "text", "text": "..."}]`); text parts
are joined with newlines, as vLLM does for text-only models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        if not content:
            raise ValueError(f"{where}.content is an empty list; give a string or text parts.")
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"{where}.content[{j}] has unsupported type {kind!r}; only text parts are supported.")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}.")


def normalize_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError("messages must be a list of {role, content} objects.")
    if not messages:
        raise ValueError("messages is empty; give at least one message.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where} must be an object with role and content.")
        role = m.get("role")
        if role not in VALID_ROLES:
            raise ValueError(f"{where}.role must be one of {', '.join(VALID_ROLES)}, got {role!r}.")
        if "content" not in m or m["content"] is None:
            if role == "assistant":
                out.append({"role": role, "content": ""})
                continue
            raise ValueError(f"{where}.content is missing.")
        out.append({"role": role, "content": _content_text(m["content"], where)})
    return out


def render_chat(
    tokenizer: Any,
    messages: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this engine has none (skip_tokenizer_init).")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template; pass chat_template (a Jinja string).")
    return tokenizer.apply_chat_template(
        normalize_messages(messages),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        **(chat_template_kwargs or {}),
    )
