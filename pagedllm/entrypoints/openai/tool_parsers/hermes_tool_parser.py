"""hermes (Qwen2.5 / Qwen3, NousResearch Hermes): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""

from __future__ import annotations

import json
import re

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import MarkerToolParser, ToolCall, ToolParseError

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class Hermes2ProToolParser(MarkerToolParser):
    name = "hermes"
    marker = "<tool_call>"

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        bodies = _BLOCK.findall(tool_text)
        if final:
            tail = tool_text[tool_text.rfind("</tool_call>") + len("</tool_call>"):] if bodies else tool_text
            if tail.strip().startswith("<tool_call>"):
                bodies.append(tail.strip()[len("<tool_call>"):])  # a last block the model did not close
        calls: list[ToolCall] = []
        for body in bodies:
            try:
                calls.append(ToolCall.from_obj(json.loads(body)))
            except (json.JSONDecodeError, RecursionError) as e:
                raise ToolParseError(f"a <tool_call> block is not valid JSON: {type(e).__name__}: {e}", calls) from None
            except ToolParseError as e:
                raise ToolParseError(str(e), calls) from None
        return calls
