"""chat_utils.normalize_messages on messages h61's fuzzer sent (tests/reliability/fuzz_surfaces.py)."""

from __future__ import annotations

import pytest

from pagedllm.entrypoints.chat_utils import normalize_messages


def _assistant_call(arguments: object) -> list[dict]:
    return [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]


@pytest.mark.parametrize("arguments", ["[" * 20000 + "]" * 20000, '{"a": ' * 5000 + "1" + "}" * 5000])
def test_arguments_nested_deeper_than_json_goes_are_a_value_error(arguments):
    """Was RecursionError out of json.loads: a 500 from the server (the body's own nesting is
    bounded when it is read, but arguments are a string inside it)."""
    with pytest.raises(ValueError, match=r"messages\[0\].tool_calls\[0\].function.arguments is not valid JSON"):
        normalize_messages(_assistant_call(arguments))


def test_arguments_parsed_for_the_template():
    (msg,) = normalize_messages(_assistant_call('{"city": "Paris"}'))
    assert msg["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
