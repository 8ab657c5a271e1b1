"""Request fields whose feature is not built yet: a 400 naming the field, never 200 with
unconstrained text.

Tool calling and structured outputs are served (structured_fields.py, serving_chat.py); what is
left here are the deprecated function-calling fields, OpenAI's output modalities other than text
(audio answers, web search), and vLLM's fields for features not built (priority, prompt_embeds, ...):
a client that asks for them would read the answer as if it had what it asked for.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError

# Tool calling and structured outputs are built (issue 22: tools, tool_choice, parallel_tool_calls,
# guided_*, structured_outputs, response_format). What is left: OpenAI's deprecated function-calling
# fields and a top-level structural_tag (vLLM takes it inside response_format / structured_outputs).
_WHY = "use tools / tool_choice (OpenAI's deprecated functions API is not served)"

UNBUILT_FIELDS: dict[str, str] = {
    "functions": _WHY,
    "function_call": _WHY,
    "structural_tag": "give it as response_format {\"type\": \"structural_tag\", ...} or structured_outputs",
    "audio": "this server answers in text only (no audio output)",
    "modalities": "this server answers in text only: give [\"text\"] or leave it out",
    "web_search_options": "this server has no web search (give retrieved text in the messages)",
    # vLLM's own request fields for features not built here: each changes the answer (or its order), so
    # a vLLM client that sets one must hear it is not honoured.
    "priority": "priority scheduling is not built (first come, first served); send 0 or leave it out",
    "prompt_embeds": "prompt embeddings are not served; send the prompt as text or token ids",
    "logits_processors": "per-request logits processors are not built",
    "logprob_token_ids": "logprobs of chosen token ids are not built; use logprobs / top_logprobs",
    "truncation_side": "truncate_prompt_tokens keeps the last tokens only: give \"left\" or leave it out",
    "thinking_token_budget": "a thinking token budget is not built; give -1 or leave it out",
    "repetition_detection": "repetition detection is not built",
}

# The value of a vLLM field above that asks for what this server does anyway (vLLM's default).
_DEFAULTS: dict[str, Any] = {"priority": 0, "truncation_side": "left", "thinking_token_budget": -1}


def _asks_for_nothing(name: str, value: Any) -> bool:
    if value is None or value == [] or value == {}:
        return True
    if name == "tool_choice" and value == "none":
        return True
    if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
        return True
    if name == "modalities" and value == ["text"]:
        return True
    if name in _DEFAULTS:
        # bool is an int: priority=false is not priority 0 (vLLM's int field refuses it), nor 0 true
        return type(value) is type(_DEFAULTS[name]) and value == _DEFAULTS[name]
    return name == "parallel_tool_calls"  # meaningless without tools, which are refused


def refuse_unbuilt_fields(request: Any) -> None:
    """400 for the first field of UNBUILT_FIELDS the request sets to something that asks for it."""
    values = dict(request.model_extra or {})
    for name in UNBUILT_FIELDS:
        if name in type(request).model_fields:
            values[name] = getattr(request, name)
    for name, why in UNBUILT_FIELDS.items():
        if name in values and not _asks_for_nothing(name, values[name]):
            raise APIError(f"{name} is not supported: {why} (the request would not get what it asked for).",
                           param=name)
