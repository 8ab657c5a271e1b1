"""pythonic (Llama 3.2 / 4, ToolACE): the output is a Python list of calls,
[get_weather(city="Paris", days=2), get_time()], optionally inside <|python_start|>...<|python_end|>.
Arguments must be literals that JSON can hold (ast.literal_eval; no bytes, sets, complex numbers,
NaN); calls are complete only when the list closes. Text after the closed list is no call: the
list's calls stand (a stream sent them when the list closed) and the rest is dropped.

    '[f(x=1), g()] and more'  -> [f({"x": 1}), g({})]     (final: ToolParseError carrying both)
    '[f(x=1), g(1)]'          -> ToolParseError, no calls   (g(1) is not name(keyword=value))
"""

from __future__ import annotations

import ast

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    LeadingToolParser,
    ToolCall,
    ToolParseError,
    arguments_json,
)

# How many ']' a search for the end of the leading list tries (each try parses the text before it).
_MAX_LIST_ENDS = 64


def _parse(text: str) -> ast.expr | None:
    """The expression `text` is, or None when it is not one (yet)."""
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # ValueError: a NUL byte (Python 3.11)
        return None


def _calls(tree: ast.expr) -> list[ToolCall]:
    if not isinstance(tree, ast.List):
        raise ToolParseError("pythonic tool calls must be a list of calls.")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args \
                or any(kw.arg is None for kw in node.keywords):
            raise ToolParseError("each pythonic tool call must be name(keyword=value, ...).")
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise ToolParseError(f"tool call {node.func.id!r} has an argument that is not a literal.") from None
        calls.append(ToolCall(node.func.id, arguments_json(node.func.id, args)))
    return calls


class PythonicToolParser(LeadingToolParser):
    name = "pythonic"
    openers = ("[", "<|python_start|>")

    def __init__(self, tokenizer: object) -> None:
        super().__init__(tokenizer)
        # A stream's text only grows, so a prefix that did not parse never will: each ']' is tried
        # once per stream. _tried: the text up to the last ']' tried; _found: the leading list's text.
        self._tried = ""
        self._tries = 0
        self._found = ""

    def parse(self, tool_text: str, final: bool) -> list[ToolCall]:
        text = tool_text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        tree = _parse(text)
        if tree is not None and isinstance(tree, ast.List):
            return _calls(tree)  # an invalid call raises: not tool calls after all
        calls = self._leading_list(text)  # a closed list that is no calls raises, at once
        if final:
            raise ToolParseError("the tool call list is not valid Python.", calls)
        return calls  # not closed yet, or closed with text after it

    def _leading_list(self, text: str) -> list[ToolCall]:
        """The calls of the list that `text` opens with, once that list is closed ("[f()] x" -> [f]);
        the first ']' before which the text parses ends it. [] while it is not closed; ToolParseError
        when it closed and is no list of calls ("[really] I think" is text)."""
        if self._found and text.startswith(self._found):
            return _calls(_parse(self._found))
        if not text.startswith(self._tried):  # another text: start over
            self._tried, self._tries = "", 0
        end = len(self._tried) - 1
        while self._tries < _MAX_LIST_ENDS:
            end = text.find("]", end + 1)
            if end < 0:
                break
            self._tries += 1
            if _parse(text[:end + 1]) is not None:
                self._found = text[:end + 1]
                return _calls(_parse(self._found))
            self._tried = text[:end + 1]
        return []
