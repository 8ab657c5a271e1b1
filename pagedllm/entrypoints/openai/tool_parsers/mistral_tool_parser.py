"""mistral: [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...] (the v3 tokenizer's form).
Mistral's chat templates require tool call ids of 9 letters and digits."""

from __future__ import annotations

import json
import secrets
import string

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    MarkerToolParser,
    ToolCall,
    ToolParseError,
    calls_from_json_values,
)

_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(MarkerToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    needs_special_tokens = True  # [TOOL_CALLS] is a control token in Mistral's tokenizers

    def make_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        text = tool_text[len(self.marker):].lstrip()
        if not text:
            if final:
                raise ToolParseError("[TOOL_CALLS] is followed by nothing.")
            return []
        if text[0] != "[":
            return calls_from_json_values(text, final)
        # Elements of the array as they complete: decode inside the brackets.
        end = _array_end(text)
        calls = calls_from_json_values(text[1:] if end is None else text[1:end], final)
        if final and end is None:
            raise ToolParseError("the [TOOL_CALLS] array is not closed.", calls)
        return calls


def _array_end(text: str) -> int | None:
    """Index of the ']' that closes the array opened at text[0], or None (not closed yet, or no JSON)."""
    try:
        value, end = json.JSONDecoder().raw_decode(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return end - 1 if isinstance(value, list) else None
