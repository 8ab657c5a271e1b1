"""Tool-call parsers by their vLLM --tool-call-parser name."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolCall, ToolParseError, ToolParser
from pagedllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json_tool_parser import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (Hermes2ProToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not available; choose from {', '.join(TOOL_PARSERS)}.")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "ToolCall", "ToolParseError", "ToolParser", "get_tool_parser"]
