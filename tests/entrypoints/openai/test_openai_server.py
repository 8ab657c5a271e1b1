"""Models, tokenizer endpoints, auth, OpenAI-shaped errors, health / version — raw HTTP and `openai`."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from pagedllm import __version__

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    for w in words:
        assert w in body["error"]["message"], body
    return body["error"]


def test_models_lists_every_served_name(tiny_server, client):
    names = [m.id for m in client.models.list().data]
    assert names == ["tiny", "tiny-alias"]
    r = client.chat.completions.create(model="tiny-alias", messages=CHAT["messages"], max_tokens=2)
    assert r.model == "tiny-alias"
    err = assert_openai_error(tiny_server.post("/v1/chat/completions", {**CHAT, "model": "nope"}), 404, "nope")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_tokenize_and_detokenize_match_the_tokenizer(tiny_server, tiny_tokenizer, tiny_chat_template):
    text = "Hello, world! Ünïcödé and 中文 too."
    r = tiny_server.post("/tokenize", {"model": "tiny", "prompt": text})
    ids = tiny_tokenizer.encode(text)
    assert r.status_code == 200 and r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    assert r.json()["max_model_len"] == 1024
    msgs = [{"role": "user", "content": text}]
    r = tiny_server.post("/tokenize", {"model": "tiny", "messages": msgs, "return_token_strs": True})
    rendered = tiny_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, chat_template=tiny_chat_template
    )
    assert rendered.startswith("CUSTOM TEMPLATE")  # --chat-template is what the server renders with
    chat_ids = tiny_tokenizer.encode(rendered, add_special_tokens=False)
    assert r.json()["tokens"] == chat_ids and r.json()["token_strs"] == tiny_tokenizer.convert_ids_to_tokens(chat_ids)
    # the chat endpoint counts exactly these tokens
    usage = tiny_server.post("/v1/chat/completions", {**CHAT, "messages": msgs}).json()["usage"]
    assert usage["prompt_tokens"] == len(chat_ids)
    r = tiny_server.post("/detokenize", {"model": "tiny", "tokens": ids})
    assert r.json()["prompt"] == tiny_tokenizer.decode(ids)
    assert_openai_error(tiny_server.post("/detokenize", {"tokens": [10**7]}), 400, "vocabulary")


def test_api_key(tiny_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-pagedllm-test"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize")):
            r = httpx.request(method, tiny_server.url(path), headers=headers, json=CHAT, timeout=10)
            assert_openai_error(r, 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=tiny_server.base_url, api_key="wrong", max_retries=0).models.list()
    # probes and monitoring stay open
    assert httpx.get(tiny_server.url("/health")).status_code == 200
    assert httpx.get(tiny_server.url("/metrics")).status_code == 200
    assert httpx.get(tiny_server.url("/version")).json() == {"version": __version__}
    # CORS preflights are answered before auth (browsers send no Authorization on them)
    r = httpx.options(tiny_server.url("/v1/chat/completions"), headers={
        "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] in ("*", "http://example.com")


@pytest.mark.parametrize(
    "body, words",
    [
        (b"{not json", ["not valid JSON"]),
        (b"[]", ["JSON object", "array"]),
        (b"null", ["JSON object"]),
        (b"", ["empty"]),
        ({"model": "tiny"}, ["messages"]),
        ({**CHAT, "messages": []}, ["empty"]),
        ({**CHAT, "messages": [{"role": "hacker", "content": "x"}]}, ["role"]),
        ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ["image_url"]),
        ({**CHAT, "max_tokens": "100"}, ["max_tokens"]),
        ({**CHAT, "max_tokens": 1.5}, ["max_tokens"]),
        ({**CHAT, "max_tokens": 0}, ["max_tokens"]),
        ({**CHAT, "temperature": 2.5}, ["temperature"]),
        ({**CHAT, "top_p": 0}, ["top_p"]),
        ({**CHAT, "n": 0}, ["n must be"]),
        ({**CHAT, "stop": ["ok", ""]}, ["stop"]),
        ({**CHAT, "top_logprobs": 2}, ["logprobs"]),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, ["max_logprobs"]),
        ({**CHAT, "stop_token_ids": [49152]}, ["stop_token_ids"]),
        ({**CHAT, "logit_bias": {"x": 1}}, ["logit_bias"]),
        ({**CHAT, "chat_template": "{{ 'x' }}"}, ["--trust-request-chat-template"]),
        ({**CHAT, "seed": 2**64}, ["seed"]),
        ({**CHAT, "stream_options": {"include_usage": True}}, ["stream_options"]),
        ({**CHAT, "use_beam_search": True}, ["use_beam_search"]),
    ],
)
def test_invalid_chat_requests_get_400_not_422(tiny_server, body, words):
    kwargs = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {}
    r = tiny_server.post("/v1/chat/completions", None if isinstance(body, bytes) else body, **kwargs)
    assert_openai_error(r, 400, *words)


def test_other_http_errors(tiny_server):
    assert_openai_error(tiny_server.post("/v1/chat/completions", content=b"hi", headers={"Content-Type": "text/plain"}),
                        400, "application/json")
    assert_openai_error(tiny_server.get("/v1/nothing"), 404)
    assert_openai_error(tiny_server.get("/v1/chat/completions"), 405)
    for prompt in ("", [], [[]], [999999]):
        assert_openai_error(tiny_server.post("/v1/completions", {"model": "tiny", "prompt": prompt}), 400, "prompt")


def test_body_over_the_limit_is_413(tiny_server):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 1_100_000}]}
    assert_openai_error(tiny_server.post("/v1/chat/completions", big), 413, "1000000")

    def chunked():  # no Content-Length: the limit holds while the body streams in
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(200):
            yield b"y" * 10_000
        yield b'"}'

    r = tiny_server.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert_openai_error(r, 413, "1000000")
    assert tiny_server.post("/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 1}).status_code == 200


def test_prompt_too_long_states_the_limit_and_counts(tiny_server):
    r = tiny_server.post("/v1/completions", {"model": "tiny", "prompt": [5] * 1000, "max_tokens": 100})
    err = assert_openai_error(r, 400, "1024", "1100", "1000", "100")
    assert err["code"] == "context_length_exceeded"
    r = tiny_server.post("/v1/completions", {"model": "tiny", "prompt": [5] * 1024, "max_tokens": 1, "stream": True})
    assert_openai_error(r, 400, "1024")


def test_unknown_fields_are_accepted_and_logged(tiny_server):
    r = tiny_server.post("/v1/chat/completions", {**CHAT, "surprise_field": 1, "tools": []})
    assert r.status_code == 200
    assert "surprise_field" in tiny_server.log() and "ignoring unknown" in tiny_server.log()


BAD_FLAGS = [
    (["--tensor-parallel-size", "3"], ["4 attention heads", "tensor_parallel_size 3"]),
    (["--chat-template", "no/such/file.jinja"], ["--chat-template"]),
]


@pytest.fixture(scope="module")
def bad_flag_starts(tiny_model_dir) -> list[tuple[int, str]]:
    """(exit status, stderr) of a server start with each of BAD_FLAGS; the processes run at once (each
    imports on one core, then stops at its check)."""
    procs = [subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model",
                               str(tiny_model_dir), *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for flags, _ in BAD_FLAGS]
    try:
        stderrs = [p.communicate(timeout=120)[1] for p in procs]
        return [(p.returncode, err) for p, err in zip(procs, stderrs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.parametrize("case", range(len(BAD_FLAGS)), ids=lambda i: BAD_FLAGS[i][0][0])
def test_unbuilt_or_bad_flags_fail_at_start(bad_flag_starts, case):
    returncode, stderr = bad_flag_starts[case]
    assert returncode == 2
    for w in BAD_FLAGS[case][1]:
        assert w in stderr


# -- fuzzer finds (tests/reliability/test_fuzz_requests.py): each was a 500, a dead engine, a hang, or
# an error naming another field than the one sent -------------------------------------------------
CMPL = {"model": "tiny", "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        # the engine process died decoding it (the server shut down)
        ("/v1/completions", {**CMPL, "structured_outputs": {"json_object": "yes"}}, "structured_outputs",
         ["structured_outputs.json_object", "true or false"]),
        ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}},
         "structured_outputs", ["disable_any_whitespace"]),
        # 500 (AttributeError)
        ("/v1/completions", {**CMPL, "structured_outputs": {"regex": "a", "backend": 5}}, "structured_outputs",
         ["structured_outputs.backend must be a string"]),
        # hung: the frontend's sender thread died on an integer msgpack cannot hold, and every later request hung
        ("/v1/completions", {**CMPL, "top_k": 10**30}, "top_k", ["top_k must be at most"]),
        ("/v1/completions", {**CMPL, "truncate_prompt_tokens": 10**30}, "truncate_prompt_tokens",
         ["truncate_prompt_tokens"]),
        # param was "prompt" (the message starts with "prompt")
        ("/v1/completions", {**CMPL, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
         ["`prompt_logprobs` are not available when `stream=True`"]),
        # named structured_outputs.regex / .grammar / .json, param null: not what was sent
        ("/v1/completions", {**CMPL, "guided_regex": "("}, "guided_regex", ["guided_regex cannot be compiled"]),
        ("/v1/chat/completions", {**CHAT, "guided_grammar": "root ::= "}, "guided_grammar",
         ["guided_grammar cannot be compiled"]),
        ("/v1/chat/completions", {**CHAT, "guided_json": {"type": "nope"}}, "guided_json", ["guided_json"]),
        ("/v1/completions", {**CMPL, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nope"}}}}, "response_format", ["response_format.json_schema.schema"]),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "structural_tag", "structures": "x",
                                                             "triggers": 1}}, "response_format", ["response_format"]),
        ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools", ["tools"]),
        # /tokenize took the reserved arguments chat completions refuse (200, or apply_chat_template's
        # "got multiple values for keyword argument" with param null)
        ("/tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs", ["chat_template_kwargs may not set tokenize"]),
        ("/tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": {"return_dict": True}},
         "chat_template_kwargs", ["return_dict"]),
        ("/tokenize", {"messages": CHAT["messages"], "chat_template_kwargs": {"conversation": 5}},
         "chat_template_kwargs", ["conversation"]),
    ],
)
def test_fuzzer_finds_are_400_naming_the_field_sent(tiny_server, path, body, param, words):
    def post(path: str, body: dict) -> httpx.Response:  # 20 s: a hang fails here, not at the suite's timeout
        return httpx.post(tiny_server.url(path), json=body, headers=tiny_server.headers, timeout=20)

    err = assert_openai_error(post(path, body), 400, *words)
    assert err["param"] == param, err
    assert tiny_server.get("/health").status_code == 200
    r = post("/v1/completions", CMPL)  # still serving
    assert r.status_code == 200, r.text



@pytest.mark.parametrize("message, param", [
    ("request id 'cmpl-x' is already in use.", "request_id"),  # two requests of one id tokenizing at once
    ("prompt_logprobs=30 is more than the server's max_logprobs (20).", "prompt_logprobs"),
    ("the prompt is empty; it needs at least one token.", "prompt"),
    ("truncate_prompt_tokens (9) is larger than the model's max_model_len (8).", "truncate_prompt_tokens"),
    ("bad_words needs a tokenizer; this engine runs without one (skip_tokenizer_init).", "bad_words"),
])
def test_engine_refusals_name_their_field(message, param):
    """serving_engine.add_request maps the engine's ValueError to the request field it is about (param
    was null or "prompt" for these). A unit test: a concurrent duplicate id is a race to reproduce."""
    import asyncio

    from pagedllm.entrypoints.openai.errors import APIError
    from pagedllm.entrypoints.openai.serving_engine import OpenAIServing

    class Engine:
        async def add_request(self, *args):
            raise ValueError(message)

    serving = object.__new__(OpenAIServing)
    serving.engine = Engine()
    with pytest.raises(APIError) as e:
        asyncio.run(serving.add_request("r", {"prompt": "x"}, None, 0.0))
    assert e.value.param == param and e.value.message == message
