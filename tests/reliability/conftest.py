"""Shared pieces of the reliability tests: a real server process on 127.0.0.1 (a free port) serving a
tiny random Llama with SmolLM2's tokenizer, OpenAI-shaped error checks, SSE reading, idle checks."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.entrypoints.conftest import make_tiny_model
from tests.entrypoints.openai.conftest import (  # noqa: F401 - _module_servers_stopped: the module autouse
    RemoteOpenAIServer,
    ServerPool,
    _module_servers_stopped,
)

MODEL = "tiny"
# Flags every reliability server shares: the tiny model, one torch thread, quiet access log.
BASE_FLAGS = ["--served-model-name", MODEL, "--cpu-threads", "1", "--seed", "0", "--disable-uvicorn-access-log"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama-reliability"))


# Every limit flag lowered (test_limits.py), and a tiny admission capacity (test_load.py): 2 running
# + 2 queued sequences.
LOW_LIMITS = ["--max-model-len", "512", "--num-gpu-blocks-override", "256", "--max-num-seqs", "2",
              "--max-num-queued-reqs", "2", "--max-n", "3", "--max-stop-strings", "2", "--max-stop-string-len", "8",
              "--max-logit-bias-entries", "2", "--max-prompt-bytes", "1000", "--max-logprobs", "3",
              "--h11-max-header-count", "20", "--h11-max-incomplete-event-size", "4096", "--disable-log-requests"]


# Issue 18's server: default request limits, the CPU budget lowered, short connection timeouts, a
# connection cap, a short --max-log-len (test_stalls.py, test_connections.py, test_logs.py).
HARDENED_READ_TIMEOUT_S = 2
HARDENED_LIMIT_CONNECTIONS = 24
HARDENED_MAX_LOG_LEN = 40
HARDENED = ["--max-model-len", "512", "--num-gpu-blocks-override", "256", "--trust-request-chat-template",
            "--max-prompt-cpu-seconds", "0.5", "--timeout-request-read", str(HARDENED_READ_TIMEOUT_S),
            "--timeout-keep-alive", "1", "--limit-concurrency", str(HARDENED_LIMIT_CONNECTIONS),
            "--max-log-len", str(HARDENED_MAX_LOG_LEN), "--enable-log-requests"]  # request lines are off by default (vLLM)


@pytest.fixture(scope="package")
def server_pool(request: pytest.FixtureRequest, tiny_model_dir: Path):
    """This package's servers, started two at a time ahead of need (ServerPool): hardened_server's,
    low_limits_server's and the modules' SERVERS, whose flags follow `--model <tiny> *BASE_FLAGS`."""
    specs, order = ServerPool.collect(request.session, Path(__file__).parent,
                                      {"hardened_server": "hardened", "low_limits_server": "low_limits"},
                                      tiny_model_dir)
    specs = {name: (["--model", str(tiny_model_dir), *BASE_FLAGS, *args], kwargs)
             for name, (args, kwargs) in specs.items()}
    specs["hardened"] = (["--model", str(tiny_model_dir), *BASE_FLAGS, *HARDENED], {})
    specs["low_limits"] = (["--model", str(tiny_model_dir), *BASE_FLAGS, *LOW_LIMITS], {})
    pool = ServerPool(specs, order)
    ServerPool.live.append(pool)
    yield pool
    pool.stop_all()
    ServerPool.live.remove(pool)


@pytest.fixture(scope="package")
def hardened_server(server_pool: ServerPool) -> RemoteOpenAIServer:
    return server_pool.take("hardened")


@pytest.fixture(scope="package")
def low_limits_server(server_pool: ServerPool) -> RemoteOpenAIServer:
    return server_pool.take("low_limits")


def assert_openai_error(r: httpx.Response, status: int, *words: str) -> dict:
    """OpenAI's error body, exactly: {"error": {"message", "type", "param", "code"}}, whose message
    contains every word."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    err = body["error"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error"), err
    for w in words:
        assert w in err["message"], (w, err)
    return err


def parse_sse(lines: list[str]) -> tuple[list[dict], bool]:
    """SSE `data:` lines -> (JSON events, whether the stream ended with [DONE])."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    done = bool(data) and data[-1] == "[DONE]"
    return [json.loads(d) for d in (data[:-1] if done else data)], done


def assert_idle(server: RemoteOpenAIServer, timeout: float = 10.0) -> dict:
    """0 running, 0 waiting and a fully free KV pool, read from /metrics."""
    m = server.wait_idle(timeout)
    assert m[("vllm:num_requests_running", ())] == 0, m
    assert m[("vllm:num_requests_waiting", ())] == 0, m
    assert m[("vllm:kv_cache_usage_perc", ())] == 0, m
    return m
