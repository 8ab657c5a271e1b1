"""A server started the vLLM way: vLLM's flags, VLLM_API_KEY, vLLM's metric names (every series
vLLM's Grafana dashboard queries), the periodic stats line, and request fields that are built
(allowed_token_ids, bad_words, truncate_prompt_tokens) or refused by name (tools, guided_*, ...).
One in-process app (FastAPI TestClient) on a tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

KEY = "sk-vllm-test"
GRAFANA_NAMES = Path(__file__).resolve().parents[2] / "metrics" / "grafana_metric_names.txt"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    from fastapi.testclient import TestClient

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app, parse_server_args

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_API_KEY", KEY)
    mp.delenv("PAGEDLLM_API_KEY", raising=False)
    args = parse_server_args([
        "--model", str(tiny_model_dir), "--served-model-name", "tiny", "--max-model-len", "512",
        "--num-gpu-blocks-override", "256", "--enable-request-id-headers", "--response-role", "bot",
        "--return-tokens-as-token-ids", "--enable-force-include-usage", "--enable-log-requests",
        "--max-log-len", "5", "--trust-request-chat-template",
    ])
    engine = AsyncLLM(EngineArgs.from_cli_args(args).create_engine_config())
    app = build_app(args, engine)
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as c:
        c.app_state = app.state
        yield c
    mp.undo()


def chat(client, **extra):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": 0, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_vllm_api_key_is_required(client):
    r = client.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401


def test_ping_answers_get_and_post_without_the_key(client):
    """vLLM serves /ping on GET and POST (SageMaker's health check posts); POST was a 405."""
    for method in ("GET", "POST"):
        assert client.request(method, "/ping", headers={"Authorization": ""}).status_code == 200


def test_request_id_header_and_response_role(client):
    r = chat(client)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "bot"
    assert len(r.headers["x-request-id"]) == 32
    assert chat(client, n=1).headers["x-request-id"] != r.headers["x-request-id"]
    assert client.get("/health", headers={"X-Request-Id": "mine"}).headers["x-request-id"] == "mine"


def test_x_request_id_header_names_the_request(client):
    """vLLM takes the request's id from X-Request-Id, over the body's request_id (was ignored)."""
    r = chat(client, request_id="body-id")
    assert r.json()["id"] == "chatcmpl-body-id"
    r = client.post("/v1/chat/completions", headers={"X-Request-Id": "gateway-7"},
                    json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                          "request_id": "body-id"})
    assert r.json()["id"] == "chatcmpl-gateway-7" and r.headers["x-request-id"] == "gateway-7", r.text
    r = client.post("/v1/completions", headers={"X-Request-Id": "gateway-8"},
                    json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    assert r.json()["id"] == "cmpl-gateway-8", r.text
    r = client.post("/v1/completions", headers={"X-Request-Id": "g" * 513}, json={"model": "tiny", "prompt": "Hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text


def test_tokens_as_token_ids_and_forced_usage(client):
    r = chat(client, logprobs=True, top_logprobs=2)
    assert all(c["token"].startswith("token_id:") for c in r.json()["choices"][0]["logprobs"]["content"])
    # vLLM's per-request field overrides the flag (it was an unknown field, ignored)
    r = chat(client, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=False)
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert not any(t["token"].startswith("token_id:") for c in content for t in [c, *c["top_logprobs"]]), content
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3, "logprobs": 1,
                                              "return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in r.json()["choices"][0]["logprobs"]["tokens"]), r.text
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4,
                                                         "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4


# Tool calling and structured outputs are built (issue 22, tests/structured_output and
# test_tool_calling.py); OpenAI's deprecated function-calling fields are still refused by name.
@pytest.mark.parametrize("field,value", [
    ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("structural_tag", '{"type": "structural_tag"}'), ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("web_search_options", {"search_context_size": "low"}),
    # vLLM's fields for features not built: were ignored, the answer read as if they were honoured
    ("priority", 1), ("priority", False), ("prompt_embeds", "AAAA"), ("logits_processors", ["m.Proc"]),
    ("logprob_token_ids", [5]), ("truncation_side", "right"), ("thinking_token_budget", 10),
    ("repetition_detection", {"min_pattern_size": 2}),
])
def test_unbuilt_fields_are_refused_by_name(client, field, value):
    r = chat(client, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]


def test_fields_that_ask_for_nothing_pass(client):
    assert chat(client, response_format={"type": "text"}, tool_choice="none",
                modalities=["text"]).status_code == 200
    assert chat(client, priority=0, truncation_side="left", thinking_token_budget=-1, prompt_embeds=None).status_code \
        == 200


def test_documents_reach_the_template(client, tiny_tokenizer):
    """vLLM's documents (RAG) are given to the chat template; they were an unknown field, ignored."""
    template = "{% for d in documents or [] %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[-1].content }}"
    docs = [{"title": "Paris", "text": "capital of France"}]
    r = chat(client, chat_template=template, documents=docs, return_token_ids=True, max_tokens=1)
    assert tiny_tokenizer.decode(r.json()["prompt_token_ids"]) == "[Paris: capital of France]Hello there", r.text
    r = chat(client, chat_template=template, return_token_ids=True, max_tokens=1)
    assert tiny_tokenizer.decode(r.json()["prompt_token_ids"]) == "Hello there", r.text
    assert chat(client, documents="Paris").json()["error"]["param"] == "documents"
    # reasoning_effort reaches the template too, as vLLM gives it (was an unknown field)
    template = "{{ reasoning_effort | default('unset') }}: {{ messages[-1].content }}"
    for extra, shown in [({"reasoning_effort": "low"}, "low"), ({}, "unset"),
                         ({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}}, "high")]:
        r = chat(client, chat_template=template, return_token_ids=True, max_tokens=1, **extra)
        assert tiny_tokenizer.decode(r.json()["prompt_token_ids"]) == f"{shown}: Hello there", r.text


def test_bad_words_and_allowed_token_ids_and_truncation(client, tiny_tokenizer):
    free = chat(client, max_tokens=12).json()["choices"][0]["message"]["content"]
    word = next(w for w in free.split() if w.strip())
    banned = chat(client, max_tokens=12, bad_words=[word]).json()["choices"][0]["message"]["content"]
    assert word not in banned.split()
    ids = [tiny_tokenizer.encode(" a", add_special_tokens=False)[0], tiny_tokenizer.encode(" b", add_special_tokens=False)[0]]
    r = chat(client, allowed_token_ids=ids, logprobs=True)
    assert {int(c["token"].split(":")[1]) for c in r.json()["choices"][0]["logprobs"]["content"]} <= set(ids)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(5, 1005)), "max_tokens": 2,
                                              "truncate_prompt_tokens": 10})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 10, r.text
    # -1: as many as leave room for max_tokens (vLLM's max_model_len - max_tokens; was 511 and a 400)
    for max_tokens, kept in [(2, 510), (None, 511)]:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": list(range(5, 1005)), "max_tokens": max_tokens,
                                                  "truncate_prompt_tokens": -1, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == kept, r.text


def test_metrics_have_vllm_names_and_every_grafana_series(client):
    assert chat(client).status_code == 200
    text = client.get("/metrics").text
    samples = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    wanted = [line for line in GRAFANA_NAMES.read_text().splitlines() if line and not line.startswith("#")]
    missing = [n for n in wanted if n not in samples]
    assert not missing, missing
    assert samples["vllm:num_requests_running"].labels == {"model_name": "tiny"}
    for name in ("vllm:kv_cache_usage_perc", "vllm:iteration_tokens_total_bucket", "vllm:request_params_n_bucket",
                 "pagedllm:request_rejected_total", "pagedllm:num_admitted_seqs"):
        assert name in samples, name
    assert not [n for n in samples if n.startswith("pagedllm:") and n not in (
        "pagedllm:request_rejected_total", "pagedllm:request_rejected_created", "pagedllm:num_admitted_seqs",
        "pagedllm:request_unknown_fields_total", "pagedllm:request_unknown_fields_created")]
    ok = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == "vllm:request_success_total")
    assert ok >= 1


def test_periodic_stats_line(client):
    stats = client.app_state.log_stat_logger
    assert chat(client).status_code == 200
    line = stats.log()
    assert "Avg prompt throughput:" in line and "Running: 0 reqs" in line and "GPU KV cache usage:" in line
    stats.log()  # idle
    assert stats.log() is None  # idle twice: nothing printed


def test_disable_log_stats_drops_the_stats_line_only(client, tiny_model_dir):
    from pagedllm.entrypoints.openai.api_server import build_app, parse_server_args

    engine = client.app_state.engine
    before = list(engine.stat_loggers)
    args = parse_server_args(["--model", str(tiny_model_dir), "--disable-log-stats"])
    app = build_app(args, engine)  # not started: only what it registers is looked at
    try:
        assert app.state.log_stat_logger is None and app.state.stat_logger is not None
        assert len(engine.stat_loggers) == len(before) + 1  # the Prometheus logger only
    finally:
        engine.stat_loggers[:] = before
