"""One chat choice's text -> reasoning_content, content and tool_calls, streamed or whole.

The same `feed` serves both: the stream calls it with each text delta (final on the last one);
a full response calls it once with the whole text and final=True, then reads `message()`.

Stages: (1) the reasoning parser splits off the thinking text; (2) the answer goes through the
tool mode:
    none      content as is
    auto      the --tool-call-parser finds tool calls in it; text before them is content
    required  the grammar made it a JSON array [{"name": ..., "parameters": {...}}, ...]
    named     the grammar made it the named function's arguments object
Tool-call deltas follow OpenAI's wire format: a call's first delta carries index, id, type and
function.name (arguments ""); later ones carry index and argument fragments. `auto` and `required`
send each call once it is complete (its arguments in one fragment); `named` streams the argument
text as it is generated.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers import ToolCall, ToolParseError, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import decode_json_values
from pagedllm.reasoning import ReasoningParser


def required_tools_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """tool_choice="required" as a JSON schema (vLLM's): at least one {"name", "parameters"} whose
    parameters validate against that function's schema."""
    options = []
    for t in tools:
        fn = t["function"]
        options.append({
            "properties": {"name": {"type": "string", "enum": [fn["name"]]},
                           "parameters": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "parameters"],
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _tool_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


class ChoiceOutputParser:
    def __init__(
        self,
        reasoning_parser: ReasoningParser | None,
        tool_mode: str,
        tool_parser: ToolParser | None = None,
        named_function: str | None = None,
    ) -> None:
        assert tool_mode in ("none", "auto", "required", "named")
        assert tool_mode != "auto" or tool_parser is not None
        self.reasoning_parser = reasoning_parser
        self.tool_mode = tool_mode
        self.tool_parser = tool_parser
        self.named_function = named_function
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.tool_calls: list[dict[str, Any]] = []  # complete calls, OpenAI's message shape
        self._content_sent = 0  # characters of the answer already sent as content
        self._tool_start: int | None = None
        self._named_args_sent = 0

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)

    def feed(self, delta: str, final: bool) -> tuple[str, str, list[dict[str, Any]]]:
        """-> (reasoning delta, content delta, tool-call deltas)."""
        self.text += delta
        if self.reasoning_parser is not None:
            reasoning, answer = self.reasoning_parser.split(self.text, final)
        else:
            reasoning, answer = "", self.text
        r_delta = reasoning[len(self.reasoning):]  # split() only ever extends what it returned
        self.reasoning = reasoning
        if answer is None:
            return r_delta, "", []
        content_delta, tool_deltas = self._answer(answer, final)
        self.content += content_delta
        return r_delta, content_delta, tool_deltas

    def _answer(self, answer: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.tool_mode == "none":
            return self._content_upto(answer, len(answer)), []
        if self.tool_mode == "named":
            return "", self._named(answer)
        if self.tool_mode == "required":
            return "", self._required(answer, final)
        parser = self.tool_parser
        assert parser is not None
        content = ""
        if self._tool_start is None:
            start = parser.start_index(answer)
            if start is None:
                safe = len(answer) - (0 if final else parser.holdback(answer))
                return self._content_upto(answer, safe), []
            content = self._content_upto(answer, start)
            self._tool_start = start
        tool_text = answer[self._tool_start:]
        try:
            calls = parser.parse(tool_text, final)
        except ToolParseError as e:
            if not self.tool_calls and not e.calls:  # not tool calls after all: the text is content (vLLM's rule)
                self._tool_start = None
                return content + self._content_upto(answer, len(answer)), []
            # The valid calls before the break stand (a stream sent them as they completed; a whole
            # answer says the same); the text that broke is dropped.
            calls = e.calls
        deltas = self._emit(calls[len(self.tool_calls):], parser.make_id)
        return content, deltas

    def _content_upto(self, answer: str, end: int) -> str:
        if end <= self._content_sent:
            return ""
        piece = answer[self._content_sent:end]
        self._content_sent = end
        return piece

    def _emit(self, calls: list[ToolCall], make_id) -> list[dict[str, Any]]:
        deltas = []
        for call in calls:
            index = len(self.tool_calls)
            call_id = make_id()
            self.tool_calls.append({"id": call_id, "type": "function",
                                    "function": {"name": call.name, "arguments": call.arguments}})
            deltas.append({"index": index, "id": call_id, "type": "function",
                           "function": {"name": call.name, "arguments": ""}})
            deltas.append({"index": index, "function": {"arguments": call.arguments}})
        return deltas

    def _named(self, answer: str) -> list[dict[str, Any]]:
        deltas = []
        if not self.tool_calls:
            call_id = _tool_id()
            self.tool_calls.append({"id": call_id, "type": "function",
                                    "function": {"name": self.named_function, "arguments": ""}})
            deltas.append({"index": 0, "id": call_id, "type": "function",
                           "function": {"name": self.named_function, "arguments": ""}})
        fragment = answer[self._named_args_sent:]
        if fragment:
            self._named_args_sent = len(answer)
            self.tool_calls[0]["function"]["arguments"] = answer
            deltas.append({"index": 0, "function": {"arguments": fragment}})
        return deltas

    def _required(self, answer: str, final: bool) -> list[dict[str, Any]]:
        text = answer.lstrip()
        if not text.startswith("["):
            return []
        try:
            values, _ = decode_json_values(text[1:].rstrip().removesuffix("]"), final and text.rstrip().endswith("]"))
        except ToolParseError:
            values = []
        calls = []
        for v in values[len(self.tool_calls):]:
            if isinstance(v, dict) and isinstance(v.get("name"), str):
                calls.append(ToolCall(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False)))
        return self._emit(calls, _tool_id)

    def message(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning_content, content, tool_calls) of the whole output, after feed(..., final=True)."""
        content = self.content
        if self.tool_calls and self.tool_mode == "auto":
            content = content.rstrip()
        return self.reasoning or None, (content or None) if self.tool_mode != "none" or self.tool_calls else content, \
            self.tool_calls

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's rule: "tool_calls" when auto parsing found calls, or required ended normally."""
        if engine_reason is None:
            return None
        if (self.tool_mode == "auto" and self.tool_calls) or (self.tool_mode == "required" and engine_reason == "stop"):
            return "tool_calls"
        return engine_reason
