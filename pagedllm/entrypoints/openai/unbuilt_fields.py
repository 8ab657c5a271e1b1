"""Request fields whose feature is not built yet: a 400 naming the field, never 200 with
unconstrained text.

Tool calling and structured outputs (tools, tool_choice, guided_*, structured_outputs,
response_format json) are issue 22's: its engineer builds them and removes their entries here.
`response_format: {"type": "text"}` and `tool_choice: "none"` ask for nothing and pass.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.errors import APIError

_WHY = "tool calling and structured outputs are not supported by this server yet"

UNBUILT_FIELDS: dict[str, str] = {
    "tools": _WHY,
    "tool_choice": _WHY,
    "functions": _WHY,
    "function_call": _WHY,
    "parallel_tool_calls": _WHY,
    "guided_json": _WHY,
    "guided_regex": _WHY,
    "guided_choice": _WHY,
    "guided_grammar": _WHY,
    "guided_decoding_backend": _WHY,
    "guided_whitespace_pattern": _WHY,
    "structural_tag": _WHY,
    "structured_outputs": _WHY,
    "response_format": _WHY,
}


def _asks_for_nothing(name: str, value: Any) -> bool:
    if value is None or value == [] or value == {}:
        return True
    if name == "tool_choice" and value == "none":
        return True
    if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
        return True
    return name == "parallel_tool_calls"  # meaningless without tools, which are refused


def refuse_unbuilt_fields(request: Any) -> None:
    """400 for the first field of UNBUILT_FIELDS the request sets to something that asks for it."""
    values = dict(request.model_extra or {})
    for name in UNBUILT_FIELDS:
        if name in type(request).model_fields:
            values[name] = getattr(request, name)
    for name, why in UNBUILT_FIELDS.items():
        if name in values and not _asks_for_nothing(name, values[name]):
            raise APIError(f"{name} is not supported: {why} (the request would get unconstrained text).", param=name)
