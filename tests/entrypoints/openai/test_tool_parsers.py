"""The tool-call parsers (entrypoints/openai/tool_parsers/) on outputs h61's fuzzer found
(tests/reliability/fuzz_tools.py): each raised an exception that was no ToolParseError (a 500, or an
in-band error mid-stream), or returned arguments that are not JSON, or a call with no name."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParseError


@pytest.mark.parametrize("literal", ["b'x'", "1+2j", "{1, 2}", "...", "{(1, 2): 3}"])
def test_pythonic_literal_json_cannot_hold_is_no_call(literal):
    """Was TypeError: Object of type bytes is not JSON serializable (json.dumps of literal_eval's value)."""
    parser = TOOL_PARSERS["pythonic"](None)
    with pytest.raises(ToolParseError, match="JSON cannot hold"):
        parser.parse(f"[f(a={literal})]", final=True)


@pytest.mark.parametrize("name, text", [
    ("pythonic", "[f(a=1e999)]"),
    ("pythonic", "[f(a=float('nan'))]"),  # not a literal: refused before
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": NaN}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": Infinity}"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": -Infinity}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": NaN}}]'),
])
def test_nan_and_infinity_are_no_call(name, text):
    """Python's json reads NaN / Infinity; the arguments were sent as '{"a": NaN}', which no JSON
    parser (the client's) reads."""
    with pytest.raises(ToolParseError):
        TOOL_PARSERS[name](None).parse(text, final=True)


@pytest.mark.parametrize("name, text", [
    ("hermes", "<tool_call>" + "[" * 20000 + "]" * 20000 + "</tool_call>"),
    ("hermes", '<tool_call>{"name": "f", "arguments": "' + "[" * 20000 + '"}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * 20000 + "]" * 20000 + "}}"),
    ("mistral", "[TOOL_CALLS] [" + "[" * 20000 + "]" * 20000 + "]"),
    ("pythonic", "[f(a=" + "[" * 20000 + "]" * 20000 + ")]"),
])
@pytest.mark.parametrize("final", [True, False])
def test_deep_nesting_is_no_call(name, text, final):
    """Was RecursionError from json / ast (nested deeper than they go)."""
    parser = TOOL_PARSERS[name](None)
    try:
        calls = parser.parse(text, final)
    except ToolParseError:
        return
    assert not final and calls == []


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>'),
    ("llama3_json", '{"name": "", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS] [{"name": "", "arguments": {}}]'),
])
def test_an_empty_name_is_no_call(name, text):
    """A call named "" was sent (no client can dispatch it)."""
    with pytest.raises(ToolParseError, match="non-empty"):
        TOOL_PARSERS[name](None).parse(text, final=True)


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{}</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", "argu'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g"'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}} and then words'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name"'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, 5]'),
    ("pythonic", "[f(x=1)]\n\nDone."),
    ("pythonic", "[f(x=1)][0]"),
])
def test_a_break_after_a_valid_call_carries_the_call(name, text):
    """The calls before the break: a stream sends each as it completes, so the final parse's error
    carries them and the whole answer keeps them too (it returned everything as content before)."""
    with pytest.raises(ToolParseError) as raised:
        TOOL_PARSERS[name](None).parse(text, final=True)
    assert [(c.name, json.loads(c.arguments)) for c in raised.value.calls] == [("f", {"x": 1})]


@pytest.mark.parametrize("text", ["[really] I think so.", "[f(x=1), g(1)]", "[f(**{'a': 1})]"])
def test_pythonic_a_closed_list_that_is_no_calls_is_refused_at_once(text):
    """Not final either: the stream releases the text as content without waiting for the end."""
    with pytest.raises(ToolParseError):
        TOOL_PARSERS["pythonic"](None).parse(text, final=False)


def test_pythonic_tries_each_list_end_once_per_stream():
    """Text after an unclosed list was parsed at up to 64 ']' on every step (a stream of many
    pieces re-parsed them all each time)."""
    parser = TOOL_PARSERS["pythonic"](None)
    text = "[f(a=[1], b=[2], c=[3]"
    assert parser.parse(text, final=False) == []
    tries = parser._tries
    assert parser.parse(text + ", d=4", final=False) == [] and parser._tries == tries
    assert [c.name for c in parser.parse(text + ")]", final=False)] == ["f"]
