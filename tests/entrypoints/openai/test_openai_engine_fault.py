"""An exception inside a model step: in-flight requests get an error, /health turns 503, and the
process exits with status 1 (the fault comes from the test-only hook PAGEDLLM_TEST_FAIL_AT_STEP)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from pagedllm.engine.core_client import FAULT_INJECT_ENV
from tests.entrypoints.openai.conftest import MODEL_DIR

FAULT_STEP = 150  # steps take ~1 ms here: room for the second request to join first
# Started by the package's server pool (conftest.ServerPool) beside the next server it needs.
SERVERS = {"fault": (["--model", MODEL_DIR, "--max-model-len", "512", "--num-gpu-blocks-override", "256",
                      "--cpu-threads", "1"], {"env": {FAULT_INJECT_ENV: str(FAULT_STEP)}})}


def test_engine_fault_fails_requests_turns_health_503_and_exits_1(tiny_model_dir, server_pool):
    server = server_pool.take("fault", __name__)
    assert httpx.get(server.url("/health")).status_code == 200
    body = {"model": str(tiny_model_dir), "prompt": "doomed", "max_tokens": 300}
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", server.url("/v1/completions"), json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            events = []
            for line in lines:  # the stream runs: now the second request joins it, long before the fault
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    break
            non_stream = pool.submit(httpx.post, server.url("/v1/completions"), json=body, timeout=30)
            events += [line[len("data: "):] for line in lines if line.startswith("data: ")]
        failed = non_stream.result()
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "engine_dead"
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected fault" in error["message"] and error["type"] == "server_error"
    # Every step finished before the fault reached the stream, then the error.
    assert 1 <= len(events) - 2 <= FAULT_STEP
    health = httpx.get(server.url("/health"))
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    assert server.proc.wait(timeout=30) == 1
