"""response_format / structured_outputs / guided_* through the server, with the official openai client
and the embedded SmolLM2: 50 schemas, streaming and not, all answers validate; choice and regex
always match; chat.completions.parse with a pydantic model; bad input is a 400 naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.entrypoints.openai.conftest import RemoteOpenAIServer
from tests.structured_output.schemas import SCHEMAS

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = RemoteOpenAIServer(["--max-model-len", "1024", "--max-num-seqs", "128", "--disable-uvicorn-access-log",
                            "--num-gpu-blocks-override", "1024"])
    yield s
    s.stop()


async def _one(client: openai.AsyncOpenAI, i: int, schema: dict, stream: bool) -> tuple[str, str]:
    kwargs = dict(model=MODEL, max_tokens=100, temperature=0,
                  messages=[{"role": "user", "content": f"Reply with JSON for example {i}."}],
                  response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    parts, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_fifty_schemas_validate_streaming_and_not(server):
    async def run():
        client = server.async_client()
        jobs = [_one(client, i, s, stream) for stream in (False, True) for i, s in enumerate(SCHEMAS)]
        return await asyncio.gather(*jobs)

    texts = asyncio.run(run())
    failures = []
    for k, (text, finish) in enumerate(texts):
        schema = SCHEMAS[k % len(SCHEMAS)]
        try:
            assert finish == "stop", f"finish_reason {finish}"
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
        except (AssertionError, json.JSONDecodeError, jsonschema.ValidationError) as e:
            failures.append((k, text, str(e)[:200]))
    assert not failures, failures


def test_choice_regex_and_parse(server):
    client = server.client()
    choices = ["alpha", "beta", "gamma delta"]
    r = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, n=8, temperature=1.0, seed=3,
                                  extra_body={"guided_choice": choices})
    assert all(c.text in choices for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A phone number?"}],
                                       max_tokens=20, n=8, temperature=1.0, seed=4,
                                       extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.message.content) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt='{"city": "Paris"}\n{"city": "Rome"}\n', max_tokens=60,
                                  temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].text
    assert isinstance(json.loads(r.choices[0].text), dict)

    class Person(BaseModel):
        name: str
        age: int

    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "A person, as JSON."}],
                                           max_tokens=60, temperature=0, response_format=Person)
    assert isinstance(parsed.choices[0].message.parsed, Person)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"guided_regex": "(abc"}, "parenthesis"),
        ({"guided_json": {"type": "string", "pattern": "^a+$", "maxLength": 3}}, "maxLength"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "nope"),
        ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"guided_json": {"anyOf": []}}, "non-empty"),
        ({"guided_json": {"type": "object", "required": ["a"], "properties": {}}}, "'a'"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "only one"),
        ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "outlines"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g'"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "enable-auto-tool-choice"),
        # A grammar and another mask that leave nothing to sample (structured_output/conflicts.py).
        ({"structured_outputs": {"choice": ["yes", "no"]}, "min_tokens": 4}, "min_tokens=4 conflicts"),
        ({"guided_choice": ["yes", "no"], "allowed_token_ids": [0]}, "allowed_token_ids conflicts"),
        ({"structured_outputs": {"choice": ["{"]}, "bad_words": ["{"]}, "bad_words conflicts"),
        # Grammars that derive no finite string, a regex that matches nothing (productive.py).
        ({"structured_outputs": {"grammar": "root ::= root"}}, "rule 'root' derives no finite string"),
        ({"guided_grammar": 'root ::= "a" root'}, "rule 'root' derives no finite string"),
        ({"guided_grammar": 'root ::= x\nx ::= "a" x'}, "rules 'root', 'x' derive"),
        ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "matches no string"),
        ({"guided_regex": "a[^\\d\\D]"}, "guided_regex matches no string"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "pattern": "[^\\s\\S]"}}}}, "response_format.json_schema.schema cannot be matched"),
        # xgrammar's message naming a non-ASCII character, whole.
        ({"guided_grammar": 'root ::= "é" é'}, "column 14: Unexpected character: 'é'"),
    ],
)
def test_bad_input_is_400(server, body, words):
    r = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}], **body})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    m = server.wait_idle()  # nothing held
    assert m[("vllm:num_requests_running", ())] == 0 and m[("vllm:num_requests_waiting", ())] == 0


def test_a_conflict_met_while_running_is_an_error_and_the_other_requests_keep_their_tokens(server):
    # "[0-9]{2}" at min_tokens=6: after two digits the grammar allows only EOS, which min_tokens bans
    # (not seen before queueing: a regex). The request ends with an error naming min_tokens (non-streaming:
    # a 400; streaming: an error event, then [DONE]), no token that breaks the grammar is sent, the
    # greedy requests beside it keep their tokens, and every KV block comes back.
    conflict = {"structured_outputs": {"regex": "[0-9]{2}"}, "min_tokens": 6}
    questions = ["Name a color.", "Count to five.", "What is the capital of France?"]

    async def plain(client, q):
        r = await client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, logprobs=False,
                                                 messages=[{"role": "user", "content": q}],
                                                 extra_body={"return_token_ids": True})
        return r.choices[0].token_ids

    async def conflicting(client):
        return await client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0, extra_body=conflict,
                                                    messages=[{"role": "user", "content": "A number?"}])

    async def run():
        client = server.async_client()
        alone = await asyncio.gather(*[plain(client, q) for q in questions])
        beside = await asyncio.gather(*[plain(client, q) for q in questions], conflicting(client), conflicting(client),
                                      return_exceptions=True)
        return alone, beside

    alone, beside = asyncio.run(run())
    assert beside[:3] == alone
    for e in beside[3:]:
        assert isinstance(e, openai.BadRequestError), e
        assert "min_tokens" in e.message and "no token" in e.message, e.message
    r = server.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 20, "temperature": 0, "stream": True,
                                                  "messages": [{"role": "user", "content": "A number?"}], **conflict})
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "min_tokens" in error["message"] and error["type"] == "invalid_request_error", error
    text = "".join(c["delta"].get("content") or "" for e in events[:-2] for c in json.loads(e)["choices"])
    assert re.fullmatch(r"[0-9]{0,2}", text), text
    with pytest.raises(openai.APIError, match="min_tokens"):  # the official client raises it too
        for _ in server.client().chat.completions.create(model=MODEL, max_tokens=20, temperature=0, stream=True,
                                                          messages=[{"role": "user", "content": "A number?"}],
                                                          extra_body=conflict):
            pass
    m = server.wait_idle()
    assert m[("vllm:kv_cache_usage_perc", ())] == 0 and m[("vllm:num_requests_running", ())] == 0
