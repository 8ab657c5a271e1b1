"""Chat messages -> prompt text through the tokenizer's chat template (shared by LLM.chat and the server).

Content may be a string or OpenAI's list of parts (`[{"type": "text", "text": "..."}]`); text parts
are joined with newlines, as vLLM does for text-only models.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

VALID_ROLES = ("system", "user", "assistant", "tool", "developer")

# apply_chat_template arguments a request may not set through chat_template_kwargs: they would
# change what rendering returns (token ids, tensors, dicts) instead of the template's variables, or
# collide with the arguments render_chat passes itself.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "chat_template", "add_generation_prompt", "tokenize", "padding", "truncation", "max_length",
     "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "tools", "documents"}
)


def check_chat_template_kwargs(kwargs: Any) -> None:
    """ValueError naming chat_template_kwargs when it is not an object or sets a reserved argument."""
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}.")
    bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(bad)}.")


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


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI's assistant tool_calls, with each call's arguments (a JSON string on the wire) parsed
    into an object, which is what chat templates iterate over (vLLM does the same)."""
    if not isinstance(calls, list):
        raise ValueError(f"{where}.tool_calls must be a list.")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{j}] needs function.name.")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):  # RecursionError: nested deeper than json goes
                raise ValueError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON.") from None
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def check_tools(tools: Any) -> list[str]:
    """OpenAI's tools list -> the function names; ValueError naming the first malformed tool."""
    names: list[str] = []
    for i, tool in enumerate(tools or []):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string.")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")
        names.append(fn["name"])
    return names


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
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
            if role != "assistant":
                raise ValueError(f"{where}.content is missing.")
            msg: dict[str, Any] = {"role": role, "content": ""}
        else:
            msg = {"role": role, "content": _content_text(m["content"], where)}
        # Passed through to the template: who spoke (name), the calls an assistant made, and which
        # call a tool message answers.
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def render_chat(
    tokenizer: Any,
    messages: Any,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> str:
    """`documents`: vLLM's RAG documents, given to templates that show them (others ignore them)."""
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer; this engine has none (skip_tokenizer_init).")
    if chat_template is not None and not isinstance(chat_template, str):
        raise TypeError(f"chat_template must be a Jinja template string, got {type(chat_template).__name__}.")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("the tokenizer has no chat template; pass chat_template (a Jinja string).")
    check_chat_template_kwargs(chat_template_kwargs)
    return tokenizer.apply_chat_template(
        normalize_messages(messages),
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        tools=tools or None,
        documents=documents,
        **(chat_template_kwargs or {}),
    )
