"""llama3_json (Llama 3.1 / 3.2 JSON tool calling): the output is one or more
{"name": ..., "parameters": {...}} objects (separated by ';'), optionally after <|python_tag|>."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    LeadingToolParser,
    ToolCall,
    calls_from_json_values,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(LeadingToolParser):
    name = "llama3_json"
    openers = ("{", PYTHON_TAG)
    needs_special_tokens = True  # <|python_tag|> is a special token in Llama 3's tokenizer

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        text = tool_text.lstrip()
        if text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):]
        return calls_from_json_values(text, final)
