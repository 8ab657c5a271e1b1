"""pythonic (Llama 3.2 / 4, ToolACE): the output is a Python list of calls,
[get_weather(city="Paris", days=2), get_time()], optionally inside <|python_start|>...<|python_end|>.
Arguments must be literals (ast.literal_eval); calls are complete only when the list closes."""

from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import LeadingToolParser, ToolCall, ToolParseError


class PythonicToolParser(LeadingToolParser):
    name = "pythonic"
    openers = ("[", "<|python_start|>")

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        text = tool_text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(text, mode="eval")
        except SyntaxError:
            if final:
                raise ToolParseError("the tool call list is not valid Python.") from None
            return []  # not closed yet
        if not isinstance(tree.body, ast.List):
            raise ToolParseError("pythonic tool calls must be a list of calls.")
        calls = []
        for node in tree.body.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                raise ToolParseError("each pythonic tool call must be name(keyword=value, ...).")
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            except ValueError:
                raise ToolParseError(f"tool call {node.func.id!r} has an argument that is not a literal.") from None
            calls.append(ToolCall(node.func.id, json.dumps(args, ensure_ascii=False)))
        return calls
