"""ChoiceOutputParser without a server: every parser's format, fed whole and fed in small pieces,
gives the same message; streamed deltas follow OpenAI's wire format; text that is not a tool call
stays content; reasoning splits off first."""

from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.openai.chat_output import ChoiceOutputParser, required_tools_schema
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.reasoning import get_reasoning_parser

CASES = {
    "hermes": ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {"s": "a}b"}}\n</tool_call>', "Sure."),
    "llama3_json": ('{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"s": "a}b"}}', None),
    "mistral": ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {"s": "a}b"}}]',
                None),
    "pythonic": ('[f(x=1), g(s="a}b")]', None),
}
EXPECTED = [("f", {"x": 1}), ("g", {"s": "a}b"})]


class Vocab:
    def get_vocab(self):
        return {"</think>": 7}


def feed_pieces(parser: ChoiceOutputParser, text: str, size: int):
    reasoning, content, deltas = "", "", []
    for i in range(0, len(text), size):
        r, c, d = parser.feed(text[i:i + size], final=i + size >= len(text))
        reasoning, content, deltas = reasoning + r, content + c, deltas + d
    return reasoning, content, deltas


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_parsers_whole_and_streamed(name, size):
    text, content_before = CASES[name]
    whole = ChoiceOutputParser(None, "auto", TOOL_PARSERS[name](None))
    whole.feed(text, final=True)
    _, content, calls = whole.message()
    assert content == content_before
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == EXPECTED
    assert whole.finish_reason("stop") == "tool_calls"

    streamed = ChoiceOutputParser(None, "auto", TOOL_PARSERS[name](None))
    _, content, deltas = feed_pieces(streamed, text, size)
    assert content.strip() == (content_before or "")
    heads = [d for d in deltas if "id" in d]
    assert [h["index"] for h in heads] == [0, 1]
    assert all(h["type"] == "function" and h["function"]["arguments"] == "" for h in heads)
    for index, (fn, args) in enumerate(EXPECTED):
        assert heads[index]["function"]["name"] == fn
        fragments = "".join(d["function"].get("arguments", "") for d in deltas if d["index"] == index)
        assert json.loads(fragments) == args


@pytest.mark.parametrize("name", list(CASES))
def test_plain_text_stays_content(name):
    text = "The weather is fine [really] {mostly}."
    p = ChoiceOutputParser(None, "auto", TOOL_PARSERS[name](None))
    _, content, deltas = feed_pieces(p, text, 2)
    assert content == text and not deltas
    assert p.finish_reason("stop") == "stop"


def test_broken_call_becomes_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"x": \n</tool_call>'
    p = ChoiceOutputParser(None, "auto", TOOL_PARSERS["hermes"](None))
    _, content, deltas = feed_pieces(p, text, 4)
    assert content == text and not deltas and not p.tools_called


def test_reasoning_then_tools_streamed():
    text = '<think>\nI should call f.\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    p = ChoiceOutputParser(get_reasoning_parser("qwen3")(Vocab()), "auto", TOOL_PARSERS["hermes"](None))
    reasoning, content, deltas = feed_pieces(p, text, 2)
    assert reasoning == "I should call f.\n" and content == ""
    assert deltas[0]["function"]["name"] == "f"
    r, c, calls = p.message()
    assert r == "I should call f.\n" and c is None and len(calls) == 1


@pytest.mark.parametrize("name, text, reasoning, answer", [
    ("deepseek_r1", "step one</think>\n\nThe answer.", "step one", "The answer."),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("qwen3", "<think>hmm</think>Yes.", "hmm", "Yes."),
    ("qwen3", "Just an answer.", None, "Just an answer."),
    ("qwen3", "No think block</think> here.", None, "No think block</think> here."),
])
def test_reasoning_parsers(name, text, reasoning, answer):
    for size in (1, 5, 1000):
        p = ChoiceOutputParser(get_reasoning_parser(name)(Vocab()), "none")
        r, c, _ = feed_pieces(p, text, size)
        assert (r or None, c or None) == (reasoning, answer)


def test_named_and_required_modes():
    named = ChoiceOutputParser(None, "named", named_function="f")
    _, _, deltas = feed_pieces(named, '{"x": 1}', 2)
    assert deltas[0] == {"index": 0, "id": deltas[0]["id"], "type": "function",
                         "function": {"name": "f", "arguments": ""}}
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"x": 1}
    assert named.finish_reason("stop") == "stop"  # vLLM: a named function finishes as "stop"
    required = ChoiceOutputParser(None, "required")
    _, _, deltas = feed_pieces(required, '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "parameters": {}}]', 3)
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["f", "g"]
    assert required.finish_reason("stop") == "tool_calls"
    schema = required_tools_schema([{"type": "function", "function": {"name": "f"}}], parallel=False)
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["f"]


@pytest.mark.parametrize("name, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{}</tool_call>'),
    ("llama3_json", '{"name": "f", "parameters": {"x": 1}}; {"name": "g"'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name"'),
    ("pythonic", "[f(x=1)]\n\nDone."),
])
def test_stream_and_whole_agree_after_a_broken_call(name, text):
    """h61's fuzzer: the stream sent call f when it completed, while the whole answer (the same
    text) had no calls and all of it as content; both now keep f and drop the broken rest."""
    whole = ChoiceOutputParser(None, "auto", TOOL_PARSERS[name](None))
    whole.feed(text, final=True)
    _, content, calls = whole.message()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1})]
    assert content is None and whole.finish_reason("stop") == "tool_calls"
    streamed = ChoiceOutputParser(None, "auto", TOOL_PARSERS[name](None))
    _, content, deltas = feed_pieces(streamed, text, 3)
    assert content == "" and [d["function"]["name"] for d in deltas if "id" in d] == ["f"]
