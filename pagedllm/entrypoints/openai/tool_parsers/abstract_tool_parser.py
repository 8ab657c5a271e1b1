"""The tool parser interface (vLLM's --tool-call-parser): find where a model's tool-call text starts
and turn it into OpenAI tool calls. One `parse` serves the whole output and every streamed prefix:

    hermes  'Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>'
            start_index -> 5; parse(text[5:], final) -> [ToolCall("f", '{"x": 1}')]

`parse(final=False)` returns only the calls that are complete so far (the stream emits each when
it is); `parse(final=True)` raises ToolParseError when the text is not valid tool calls. The error
carries the complete, valid calls before the text that broke (`calls`): a stream has sent those
already, so the whole answer keeps them too (the two agree); with none, the whole output is content
(as vLLM does).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, ClassVar


class ToolParseError(ValueError):
    def __init__(self, message: str, calls: list[ToolCall] | None = None) -> None:
        super().__init__(message)
        self.calls: list[ToolCall] = list(calls or [])  # the valid calls before the break


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object

    @staticmethod
    def from_obj(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            raise ToolParseError(f"a tool call must be an object with a non-empty string 'name', got {obj!r:.200}.")
        args = next((obj[k] for k in args_keys if k in obj), {})
        if isinstance(args, str):  # some models write arguments as a JSON string
            try:
                args = json.loads(args)
            except (json.JSONDecodeError, RecursionError):
                raise ToolParseError(f"tool call {obj['name']!r} has arguments that are not JSON.") from None
        if not isinstance(args, dict):
            raise ToolParseError(f"tool call {obj['name']!r} has arguments that are not an object.")
        return ToolCall(obj["name"], arguments_json(obj["name"], args))


def arguments_json(name: str, args: dict[Any, Any]) -> str:
    """A call's arguments as strict JSON text. Python's json reads NaN / Infinity and a pythonic call
    may hold bytes, sets or complex numbers: JSON has no spelling for those, so they are no call."""
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ToolParseError(f"tool call {name!r} has arguments JSON cannot hold: {e}") from None


def calls_from_objs(objs: list[Any]) -> list[ToolCall]:
    """Decoded values -> calls; the first that is no call raises, carrying the calls before it."""
    calls: list[ToolCall] = []
    for obj in objs:
        try:
            calls.append(ToolCall.from_obj(obj))
        except ToolParseError as e:
            raise ToolParseError(str(e), calls) from None
    return calls


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` ("ab<tool", "<tool_call>" -> 5)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def decode_json_values(text: str, final: bool, separators: str = " \t\n\r,;") -> tuple[list[Any], str]:
    """Successive JSON values in `text` ('{..}; {..}') -> (values, unparsed rest). A value cut off at
    the end is left in the rest when not final, an error when final."""
    decoder = json.JSONDecoder()
    values, i = [], 0
    while True:
        while i < len(text) and text[i] in separators:
            i += 1
        if i == len(text):
            return values, ""
        try:
            value, i = decoder.raw_decode(text, i)
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested deeper than json goes
            if final:
                raise ToolParseError(f"tool call text is not valid JSON: {type(e).__name__}: {e}") from None
            return values, text[i:]
        values.append(value)


def calls_from_json_values(text: str, final: bool) -> list[ToolCall]:
    """'{..}; {..}' -> the complete calls in it. Final: text that is not calls raises, carrying
    the calls before it (a stream sent them as they completed)."""
    values, rest = decode_json_values(text, final=False)
    calls = calls_from_objs(values)
    if final and rest:
        raise ToolParseError(f"tool call text is not valid JSON after {len(calls)} calls: {rest[:50]!r}.", calls)
    return calls


class ToolParser:
    name: ClassVar[str]
    # Tool-call markers that tokenizers mark special: decode them (skip_special_tokens=False).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start_index(self, text: str) -> int | None:
        """Where tool-call text begins in the output, or None when none has (yet)."""
        raise NotImplementedError

    def holdback(self, text: str) -> int:
        """Characters at the end of content-only text that may still become a tool-call start."""
        raise NotImplementedError

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        raise NotImplementedError

    def make_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output -> (content before the calls or None, calls); no calls: (text, [])."""
        start = self.start_index(text)
        if start is None:
            return text, []
        try:
            calls = self.parse(text[start:], final=True)
        except ToolParseError:
            return text, []
        if not calls:
            return text, []
        content = text[:start].rstrip()
        return content or None, calls


class MarkerToolParser(ToolParser):
    """Tool calls that follow a marker anywhere in the text (<tool_call>, [TOOL_CALLS])."""

    marker: ClassVar[str]

    def start_index(self, text: str) -> int | None:
        i = text.find(self.marker)
        return i if i >= 0 else None

    def holdback(self, text: str) -> int:
        return partial_suffix(text, self.marker)


class LeadingToolParser(ToolParser):
    """Tool calls that are the whole output, opened by one of `openers` after optional whitespace
    (llama3_json's '{' or <|python_tag|>, pythonic's '[')."""

    openers: ClassVar[tuple[str, ...]]

    def start_index(self, text: str) -> int | None:
        stripped = text.lstrip()
        if any(stripped.startswith(o) for o in self.openers):
            return len(text) - len(stripped)
        return None

    def holdback(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or any(o.startswith(stripped) for o in self.openers):
            return len(text)  # only whitespace, or the start of an opener: wait
        return 0
