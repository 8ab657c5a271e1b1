"""`pagedllm bench serve` against our own server (a subprocess on 127.0.0.1, tiny model, a dozen requests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pagedllm.benchmarks.datasets import random_requests
from pagedllm.benchmarks.serve import RequestFuncOutput, _chunk_delta, build_requests, calculate_metrics
from pagedllm.entrypoints.cli import main
from tests.utils import smollm_tokenizer, tiny_model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tiny_model("qwen3", with_tokenizer=True)[0]
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port),
           "--model", model, "--served-model-name", "tiny", "--max-num-seqs", "8"]
    # vLLM's CPU KV-cache size variable, as its CPU users set it: the default 4 GiB is 262,144 blocks of
    # this tiny model, and the suite's per-step block-pool check (PAGEDLLM_DEBUG_BLOCKS) walks them all.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "0.01"}
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"server exited:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"server not ready:\n{log.read_text()}"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_bench_serve_against_our_server(server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    rc = main(["bench", "serve", "--base-url", server, "--model", "tiny", "--dataset", "random", "--num-prompts", "12",
               "--input-len", "16", "--output-len", "6", "--random-token-max", "500", "--request-rate", "200",
               "--max-concurrency", "4", "--output-json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    for field in ("Successful requests:", "Failed requests:", "Request throughput (req/s):",
                  "Output token throughput (tok/s):", "Mean TTFT (ms):", "P99 TTFT (ms):", "Median (P50) TPOT (ms):",
                  "P90 ITL (ms):"):
        assert field in text
    m = json.loads(out.read_text())
    assert (m["completed"], m["failed"]) == (12, 0)
    assert m["total_input_tokens"] == 12 * 16 and m["output_lens"] == [6] * 12  # ignore_eos: exactly 6 each
    assert m["output_throughput"] == pytest.approx(72 / m["duration"])
    assert 0 < m["median_ttft_ms"] <= m["p99_ttft_ms"] and 0 < m["mean_tpot_ms"] and 0 < m["p90_itl_ms"]
    # One chunk per token after the first, fewer when the server merged deltas for a slow reader.
    assert all(1 <= len(itl) <= 5 for itl in m["itls"])


def test_bench_serve_unknown_model_fails_fast(server: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--base-url", server, "--model", "nope", "--num-prompts", "2", "--input-len", "4",
               "--output-len", "2", "--random-token-max", "500", "--ready-check-timeout-sec", "5"])
    assert rc == 2 and "HTTP 404" in capsys.readouterr().err


def test_chunk_delta_and_metrics() -> None:
    assert _chunk_delta({"choices": [{"text": "a", "finish_reason": None}]}, chat=False) == (True, "a", 0)
    assert _chunk_delta({"choices": [{"text": "", "token_ids": [5, 6]}]}, chat=False) == (True, "", 2)
    assert _chunk_delta({"choices": [{"text": "", "finish_reason": "length"}]}, chat=False)[0] is False
    assert _chunk_delta({"choices": [], "usage": {"completion_tokens": 3}}, chat=False)[0] is False
    assert _chunk_delta({"choices": [{"delta": {"content": "hi"}}]}, chat=True) == (True, "hi", 0)
    outs = [RequestFuncOutput(10, True, 5, ttft=0.1, itl=[0.02] * 4, latency=0.18),
            RequestFuncOutput(20, True, 3, ttft=0.3, itl=[0.05] * 2, latency=0.4),
            RequestFuncOutput(30, False, error="HTTP 500")]
    m = calculate_metrics(outs, duration=2.0, percentiles=[90, 99])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 8)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 4.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["mean_tpot_ms"] == pytest.approx((20 + 50) / 2)  # (latency - ttft) / (tokens - 1)
    assert m["p99_itl_ms"] == pytest.approx(50)


def test_text_prompts_from_a_tokenizer() -> None:
    tok = smollm_tokenizer()
    reqs = build_requests(random_requests(2, (20, 20), (4, 4), token_max=5000), tok)
    assert all(isinstance(r.prompt, str) and r.prompt and r.prompt_len > 0 and r.output_len == 4 for r in reqs)
    ids = build_requests(random_requests(2, (20, 20), (4, 4), token_max=5000), None)
    assert all(isinstance(r.prompt, list) and r.prompt_len == 20 for r in ids)
