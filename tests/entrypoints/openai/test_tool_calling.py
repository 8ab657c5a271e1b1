"""Tool calling and reasoning output through the server, with the openai client, one tiny random
model (SmolLM2's tokenizer + <think>/</think> tokens) and a hand-written chat template that shows
tools, tool calls and tool results in the prompt.

A random model does not call tools by itself, so the answer's text is forced with guided_choice to
what each model family writes (hermes' <tool_call> block, llama3_json's object, mistral's
[TOOL_CALLS] array, pythonic's call list); the parser, the wire format and the round trip are real.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.entrypoints.openai.conftest import RemoteOpenAIServer, start_servers

TEMPLATE = """{%- if tools %}<|im_start|>system
TOOLS: {{ tools | tojson }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for tc in m.tool_calls %}CALL {{ tc.function.name }} {{ tc.function.arguments | tojson }} id={{ tc.id }}
{% endfor %}{% endif %}{% if m.role == 'tool' %}RESULT for {{ m.tool_call_id }}: {% endif %}{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                           "required": ["zone"], "additionalProperties": False}}},
]
ARGS = {"city": "Paris", "days": 2}
# What each family's model writes for get_weather(city="Paris", days=2), with text before it where
# the format allows some.
CALL_TEXT = {
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "pythonic": '[get_weather(city="Paris", days=2)]',
}
CONTENT_BEFORE = {"hermes": "Let me check."}
# The hermes server also runs --reasoning-parser deepseek_r1; a grammar there starts after </think>, which a
# random model never writes, so its tool tests turn thinking off (the template then closes the block).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USER = {"role": "user", "content": "What is the weather in Paris for two days?"}


def write_think_model(path: Path) -> int:
    """A tiny random Llama with SmolLM2's tokenizer plus <think> / </think> and TEMPLATE, saved under
    `path` (also test_fuzz_surfaces.py's model) -> its vocabulary size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.loader.source import resolve_model
    from pagedllm.loader.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model(None))
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: ordinary (not special) added tokens
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, initializer_range=0.2, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    (path / "template.jinja").write_text(TEMPLATE)
    return len(tok)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-tools")
    write_think_model(path)
    return path


@pytest.fixture(scope="module")
def servers(model_dir) -> dict[str, RemoteOpenAIServer]:
    """One server per tool-call parser (the parser is a server flag), started two at a time."""
    args = [[
        "--model", str(model_dir), "--served-model-name", "tiny", "--max-model-len", "1024",
        "--num-gpu-blocks-override", "256", "--cpu-threads", "1", "--chat-template", str(model_dir / "template.jinja"),
        "--enable-auto-tool-choice", "--tool-call-parser", parser, "--disable-uvicorn-access-log",
        *(["--reasoning-parser", "deepseek_r1"] if parser == "hermes" else []),
    ] for parser in CALL_TEXT]
    started = dict(zip(CALL_TEXT, start_servers(args), strict=True))
    yield started
    for server in started.values():
        server.stop()


@pytest.fixture(scope="module", params=list(CALL_TEXT))
def served(request, servers):
    return request.param, servers[request.param]


def _prompt_text(server, response) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.model_dir)
    return tok.decode(response.prompt_token_ids)


def test_round_trip(served, model_dir):
    parser, server = served
    server.model_dir = model_dir
    client = server.client()
    first = client.chat.completions.create(
        model="tiny", messages=[USER], tools=TOOLS, max_tokens=160,
        extra_body={"guided_choice": [CALL_TEXT[parser]], "return_token_ids": True, **NO_THINKING},
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT_BEFORE.get(parser)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGS
    assert len(call.id) == 9 if parser == "mistral" else call.id.startswith("chatcmpl-tool-")
    assert '"name": "get_weather"' in _prompt_text(server, first)  # the tools reached the template

    answer = "It is 22C in Paris."
    history = [USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "22C and sunny"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=64,
                                           extra_body={"guided_choice": [answer], "return_token_ids": True,
                                                       **NO_THINKING})
    assert final.choices[0].message.content == answer and final.choices[0].finish_reason == "stop"
    assert not final.choices[0].message.tool_calls
    prompt = _prompt_text(server, final)
    assert 'CALL get_weather {"city": "Paris", "days": 2}' in prompt
    assert f"RESULT for {call.id}: 22C and sunny" in prompt


def test_streamed_tool_call_deltas(served):
    parser, server = served
    stream = server.client().chat.completions.create(
        model="tiny", messages=[USER], tools=TOOLS, max_tokens=160, stream=True,
        extra_body={"guided_choice": [CALL_TEXT[parser]], **NO_THINKING},
    )
    content, deltas, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        deltas += d.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert content.strip() == CONTENT_BEFORE.get(parser, "")
    head = deltas[0]  # OpenAI's wire format: index, id, type and the name first, then argument fragments
    assert head.index == 0 and head.id and head.type == "function" and head.function.name == "get_weather"
    assert all(d.index == 0 and d.id is None for d in deltas[1:])
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == ARGS


def test_required_and_named_give_valid_arguments(served):
    parser, server = served
    if parser != "hermes":
        pytest.skip("tool_choice required / named do not use the parser; one server checks them")
    client = server.client()
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=200, n=4, temperature=1.0, seed=5, extra_body=NO_THINKING)
    for c in r.choices:
        assert c.finish_reason == "tool_calls", c
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice=named,
                                       max_tokens=100, n=4, temperature=1.0, seed=6, extra_body=NO_THINKING)
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    stream = client.chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, tool_choice=named,
                                            max_tokens=100, stream=True, temperature=0, extra_body=NO_THINKING)
    deltas = [d for ch in stream if ch.choices for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_time" and deltas[0].id
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), schemas["get_time"])


def test_reasoning_then_structured_output(served, model_dir):
    parser, server = served
    if parser != "hermes":
        pytest.skip("the reasoning parser runs on the hermes server")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    end_id = tok.convert_tokens_to_ids("</think>")
    client = server.client()
    body = dict(model="tiny", messages=[{"role": "user", "content": "Think, then answer in JSON."}], max_tokens=60,
                temperature=1.0, seed=11, logit_bias={str(end_id): 12.0},
                response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": TOOLS[1]["function"][
                    "parameters"]}})
    r = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    msg = r.choices[0].message
    raw = tok.decode(r.choices[0].token_ids, skip_special_tokens=True)
    assert "</think>" in raw  # the grammar let the thinking end; the JSON came after it
    assert (msg.reasoning_content or "") == raw.split("</think>")[0].lstrip().removeprefix("<think>").lstrip("\n")
    assert json.loads(msg.content) in ({"zone": "UTC"}, {"zone": "CET"})
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    assert reasoning == (msg.reasoning_content or "") and content == msg.content
    # vLLM's include_reasoning=false: the same answer without its thinking text (was an unknown field)
    assert msg.reasoning_content
    r = client.chat.completions.create(**body, extra_body={"include_reasoning": False})
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content == msg.content
    chunks = list(client.chat.completions.create(**body, stream=True, extra_body={"include_reasoning": False}))
    assert not any(getattr(c.choices[0].delta, "reasoning_content", None) for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    # enable_thinking=false: the template closes the think block; the answer is constrained at once.
    r = client.chat.completions.create(**{**body, "logit_bias": None},
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.reasoning_content is None
    assert json.loads(r.choices[0].message.content) in ({"zone": "UTC"}, {"zone": "CET"})


def test_tokenize_counts_the_tools_the_template_shows(served):
    """serving_tokenization.py (h61's fuzzer): /tokenize took `tools` as an unknown field and left
    them out, so its count was not the chat prompt's; malformed tools are a 400 as on chat."""
    parser, server = served
    if parser != "hermes":
        pytest.skip("one server is enough")
    chat = server.client().chat.completions.create(model="tiny", messages=[USER], tools=TOOLS, max_tokens=1,
                                                   extra_body=NO_THINKING)
    r = server.post("/tokenize", {"model": "tiny", "messages": [USER], "tools": TOOLS, **NO_THINKING})
    assert r.status_code == 200 and r.json()["count"] == chat.usage.prompt_tokens, r.text
    without = server.post("/tokenize", {"model": "tiny", "messages": [USER], **NO_THINKING}).json()["count"]
    assert without < chat.usage.prompt_tokens
    r = server.post("/tokenize", {"model": "tiny", "messages": [USER], "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
