"""The catalogue of bad inputs (issue 6): against a real server each gets its status code and an
OpenAI-shaped error naming the problem; after each one the server still answers a normal request
with exactly the text it gave before, and /metrics shows 0 running, 0 waiting, a fully free KV pool."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import MODEL, assert_idle, assert_openai_error

API_KEY = "sk-reliability"
MAX_MODEL_LEN = 512
MAX_BODY = 200_000
VOCAB = 49152  # SmolLM2's tokenizer

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
NORMAL = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}


@dataclass
class Case:
    name: str
    status: int
    words: tuple[str, ...]
    body: Any = None  # dict -> JSON; bytes -> raw (application/json unless headers say otherwise)
    path: str = "/v1/chat/completions"
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)
    auth: bool = True


def chat(name: str, words: tuple[str, ...], status: int = 400, **fields: Any) -> Case:
    return Case(name, status, words, {**CHAT, **fields})


def cmpl(name: str, words: tuple[str, ...], status: int = 400, **fields: Any) -> Case:
    return Case(name, status, words, {**CMPL, **fields}, path="/v1/completions")


def raw(name: str, body: bytes, words: tuple[str, ...], **kw: Any) -> Case:
    return Case(name, 400, words, body, **kw)


CASES = [
    # -- the HTTP layer --
    raw("invalid-json", b'{"model": "tiny", "messages": [', ("not valid JSON",)),
    raw("json-array", b"[]", ("JSON object", "array")),
    raw("json-string", b'"x"', ("JSON object", "string")),
    raw("json-null", b"null", ("JSON object", "null")),
    raw("json-number", b"42", ("JSON object", "number")),
    raw("empty-body", b"", ("empty",)),
    raw("text-plain", b"hello", ("application/json",), headers={"Content-Type": "text/plain"}),
    raw("deeply-nested", b"[" * 50_000 + b"]" * 50_000, ("nested",)),
    Case("unknown-path", 404, ("/v1/nothing",), path="/v1/nothing", method="GET"),
    Case("wrong-method", 405, ("GET", "/v1/chat/completions"), method="GET"),
    Case("body-over-limit", 413, (str(MAX_BODY),), {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}),
    # -- messages --
    Case("messages-missing", 400, ("messages",), {"model": MODEL, "max_tokens": 4}),
    chat("messages-string", ("messages",), messages="hi"),
    chat("messages-empty", ("messages", "empty"), messages=[]),
    chat("role-hacker", ("role", "hacker"), messages=[{"role": "hacker", "content": "x"}]),
    chat("role-missing", ("role",), messages=[{"content": "x"}]),
    chat("content-null", ("content",), messages=[{"role": "user", "content": None}]),
    chat("content-empty-list", ("content",), messages=[{"role": "user", "content": []}]),
    chat("content-unknown-part", ("image_url",), messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    chat("request-chat-template", ("--trust-request-chat-template",), chat_template="{{ 'x' }}"),
    # -- max_tokens and the context length --
    chat("max_tokens-string", ("max_tokens",), max_tokens="100"),
    chat("max_tokens-float", ("max_tokens",), max_tokens=1.5),
    chat("max_tokens-bool", ("max_tokens",), max_tokens=True),
    chat("max_tokens-0", ("max_tokens",), max_tokens=0),
    chat("max_tokens--1", ("max_tokens",), max_tokens=-1),
    chat("max_tokens-1e30", ("max_tokens",), max_tokens=10**30),
    cmpl("context-too-long-ids", (str(MAX_MODEL_LEN), "600", "500", "100"), prompt=[5] * 500, max_tokens=100),
    cmpl("context-too-long-text", (str(MAX_MODEL_LEN), "tokens"), prompt="hello " * 600, max_tokens=4),
    chat("context-too-long-chat", (str(MAX_MODEL_LEN), "tokens"), messages=[{"role": "user", "content": "hi " * 600}]),
    # -- sampling values --
    chat("temperature-negative", ("temperature",), temperature=-0.5),
    chat("temperature-2.5", ("temperature",), temperature=2.5),
    raw("temperature-NaN", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        ("temperature",)),
    chat("top_p-0", ("top_p",), top_p=0),
    chat("top_p--1", ("top_p",), top_p=-1),
    chat("top_p-1.0001", ("top_p",), top_p=1.0001),
    chat("top_k--2", ("top_k",), top_k=-2),
    chat("top_k-1.5", ("top_k",), top_k=1.5),
    chat("min_p-1.5", ("min_p",), min_p=1.5),
    chat("presence_penalty-2.5", ("presence_penalty",), presence_penalty=2.5),
    chat("frequency_penalty--3", ("frequency_penalty",), frequency_penalty=-3),
    chat("repetition_penalty-0", ("repetition_penalty",), repetition_penalty=0),
    chat("min_tokens-over-max_tokens", ("min_tokens",), min_tokens=10, max_tokens=4),
    # -- n and logprobs --
    chat("n-0", ("n must be",), n=0),
    chat("n--1", ("n must be",), n=-1),
    chat("n-1e6", ("n must be", "--max-n"), n=1_000_000),
    cmpl("n-1e6-completions", ("n must be",), n=1_000_000),
    chat("top_logprobs-over-cap", ("top_logprobs", "max_logprobs"), logprobs=True, top_logprobs=21),
    chat("top_logprobs-negative", ("top_logprobs",), logprobs=True, top_logprobs=-1),
    chat("top_logprobs-without-logprobs", ("logprobs",), top_logprobs=2),
    cmpl("logprobs-over-cap", ("logprobs", "max_logprobs"), logprobs=21),
    cmpl("logprobs-negative", ("logprobs",), logprobs=-1),
    # -- stop, stop_token_ids, logit_bias --
    chat("stop-empty", ("stop",), stop=""),
    chat("stop-list-with-empty", ("stop",), stop=["ok", ""]),
    chat("stop-10000", ("stop", "64"), stop=[f"s{i}" for i in range(10_000)]),
    chat("stop-too-long", ("stop", "1024"), stop=["y" * 2000]),
    chat("stop_token_ids--1", ("stop_token_ids",), stop_token_ids=[-1]),
    chat("stop_token_ids-vocab", ("stop_token_ids", str(VOCAB)), stop_token_ids=[VOCAB]),
    chat("logit_bias-oov", ("logit_bias", str(VOCAB)), logit_bias={str(VOCAB + 7): 1}),
    chat("logit_bias-non-integer-key", ("logit_bias",), logit_bias={"x": 1}),
    chat("logit_bias-too-many", ("logit_bias", "1024"), logit_bias={str(i): 1 for i in range(1100)}),
    # -- completions prompts and the model --
    cmpl("prompt-empty-string", ("prompt",), prompt=""),
    cmpl("prompt-empty-list", ("prompt",), prompt=[]),
    cmpl("prompt-empty-token-list", ("prompt",), prompt=[[]]),
    cmpl("prompt-over-max-prompt-bytes", ("100000", "--max-prompt-bytes"), prompt="x" * 100_000),
    cmpl("prompt-oov-token", ("prompt", "999999", "vocabulary"), prompt=[999999]),
    cmpl("prompt-negative-token", ("prompt", "vocabulary"), prompt=[3, -1]),
    chat("unknown-model", ("nope",), status=404, model="nope"),
    cmpl("unknown-model-completions", ("nope",), status=404, model="nope"),
    # -- issue 18: bounded work before anything expensive (every list field is counted) --
    Case("json-values-over-limit", 413, ("--max-json-values",),
         b'{"model": "tiny", "prompt": [' + b",".join([b"[]"] * 60_000) + b"]}", path="/v1/completions"),
    cmpl("prompts-over-capacity", ("1032 prompts",), prompt=["a"] * 1033),
    cmpl("stop_token_ids-over-limit", ("--max-stop-token-ids", "1024"), stop_token_ids=[1] * 1025),
    chat("messages-over-limit", ("--max-messages", "2048"), messages=[{"role": "user", "content": ""}] * 2049),
    chat("content-parts-over-limit", ("--max-content-parts", "256"),
         messages=[{"role": "user", "content": [{"type": "text", "text": ""}] * 257}]),
    chat("tools-over-limit", ("--max-tools", "128"), tools=[{"type": "function"}] * 129),
    Case("detokenize-over-max-model-len", 400, ("--max-model-len",), {"model": MODEL, "tokens": [1] * 513},
         path="/detokenize"),
    cmpl("request_id-too-long", ("request_id", "512"), request_id="r" * 513),
    # -- lone UTF-16 surrogates, anywhere: 400 naming the field, before any 200 when streaming --
    cmpl("surrogate-prompt", ("prompt", "surrogate"), prompt="hi \ud800"),
    raw("surrogate-prompt-raw-bytes", b'{"model": "tiny", "prompt": "hi \xed\xa0\x80", "max_tokens": 2}',
        ("prompt", "surrogate"), path="/v1/completions"),
    cmpl("surrogate-prompt-list", ("prompt[1]", "surrogate"), prompt=["ok", "\udfff"]),
    chat("surrogate-message", ("messages[0].content", "surrogate"), messages=[{"role": "user", "content": "\ud800"}]),
    chat("surrogate-content-part", ("messages[0].content[0].text", "surrogate"),
         messages=[{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]),
    chat("surrogate-model", ("model", "surrogate"), model="tiny\ud800"),
    cmpl("surrogate-request_id", ("request_id", "surrogate"), request_id="id-\ud800"),
    cmpl("surrogate-stream-completions", ("prompt", "surrogate"), prompt="\ud800", stream=True),
    chat("surrogate-stream-chat", ("messages[0].content", "surrogate"),
         messages=[{"role": "user", "content": "\ud800"}], stream=True),
    cmpl("surrogate-in-a-field-name", ("surrogate",), **{"odd\ud800": 1}),
    cmpl("surrogate-stop", ("stop[0]", "surrogate"), stop=["\ud800"]),
    Case("surrogate-tokenize", 400, ("prompt", "surrogate"), {"model": MODEL, "prompt": "\ud800"}, path="/tokenize"),
    Case("surrogate-tokenize-chat", 400, ("messages[0].content", "surrogate"),
         {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, path="/tokenize"),
    Case("surrogate-detokenize-model", 400, ("model", "surrogate"), {"model": "\ud800", "tokens": [1]},
         path="/detokenize"),
    # -- integers past CPython's 4,300-digit limit are invalid JSON (they were a 500) --
    raw("max_tokens-5000-digits", b'{"model": "tiny", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}",
        ("not valid JSON", "4300"), path="/v1/completions"),
    raw("seed-4301-digits", b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -'
        + b"9" * 4301 + b"}", ("not valid JSON", "4300")),
    # -- errors name max_completion_tokens when the request used it --
    chat("max_completion_tokens-0", ("max_completion_tokens",), max_completion_tokens=0),
    chat("min_tokens-over-max_completion_tokens", ("min_tokens", "max_completion_tokens"), min_tokens=10,
         max_completion_tokens=4),
    # -- auth --
    Case("api-key-missing", 401, ("API key",), CHAT, auth=False),
    Case("api-key-wrong", 401, ("Incorrect API key",), CHAT, headers={"Authorization": "Bearer nope"}),
    Case("api-key-wrong-scheme", 401, ("API key",), CHAT, headers={"Authorization": f"Basic {API_KEY}"}),
    Case("api-key-docs", 401, ("API key",), path="/docs", method="GET", auth=False),
    Case("api-key-openapi", 401, ("API key",), path="/openapi.json", method="GET", auth=False),
]


# Started by the package's server pool beside the next server it needs.
SERVERS = {"catalogue": (["--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", "256",
                          "--max-num-seqs", "8", "--max-request-body-bytes", str(MAX_BODY)], {"api_key": API_KEY})}


@pytest.fixture(scope="module")
def server(server_pool):
    return server_pool.take("catalogue", __name__)


@pytest.fixture(scope="module")
def normal_answer(server) -> dict:
    r = server.post("/v1/completions", NORMAL)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] == "length"
    return {"text": choice["text"], "usage": r.json()["usage"], "sent": 1}


def send(server, case: Case) -> httpx.Response:
    headers = dict(case.headers)
    if case.auth and "Authorization" not in headers:
        headers["Authorization"] = f"Bearer {API_KEY}"
    kwargs: dict[str, Any] = {"headers": headers, "timeout": 30}
    if isinstance(case.body, bytes):
        headers.setdefault("Content-Type", "application/json")
        kwargs["content"] = case.body
    elif case.body is not None:
        # json.dumps escapes lone surrogates as \\ud800 (httpx's own encoder would fail on them).
        headers.setdefault("Content-Type", "application/json")
        kwargs["content"] = json.dumps(case.body).encode()
    return httpx.request(case.method, server.url(case.path), **kwargs)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_refused_and_the_server_is_unharmed(server, normal_answer, case: Case):
    assert_openai_error(send(server, case), case.status, *case.words)
    r = server.post("/v1/completions", NORMAL)
    normal_answer["sent"] += 1
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == normal_answer["text"]
    assert r.json()["usage"] == normal_answer["usage"]
    assert_idle(server)


def test_no_refusal_leaked_work(server, normal_answer):
    """After the whole catalogue: nothing queued, running or holding blocks, and the only sequences
    the engine ever finished are the normal requests (one per case, plus the reference)."""
    m = assert_idle(server)
    finished = sum(v for (name, _), v in m.items() if name == "vllm:request_success_total")
    assert finished == normal_answer["sent"]
    assert httpx.get(server.url("/health")).status_code == 200
