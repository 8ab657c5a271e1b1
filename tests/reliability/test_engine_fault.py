"""An exception inside a model step (the test-only hook PAGEDLLM_TEST_FAIL_AT_STEP): every request in
flight, running or queued, streaming or not, fails with an error; /health turns 503; new requests
get 503; the process exits with status 1 instead of hanging."""

from __future__ import annotations

import asyncio
import time

import httpx

from pagedllm.engine.core_client import FAULT_INJECT_ENV
from tests.reliability.conftest import MODEL, assert_openai_error, parse_sse

FAIL_AT_STEP = 100


# Started by the package's server pool beside the next server it needs.
SERVERS = {"fault": (["--max-model-len", "512", "--num-gpu-blocks-override", "256", "--max-num-seqs", "2"],
                     {"env": {FAULT_INJECT_ENV: str(FAIL_AT_STEP)}})}


def test_model_step_exception_fails_everything_and_exits_nonzero(server_pool):
    server = server_pool.take("fault", __name__)
    assert httpx.get(server.url("/health")).status_code == 200
    long = {"max_tokens": 300, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:

            async def stream(path: str, body: dict) -> tuple[int, list[dict], bool]:
                async with http.stream("POST", server.url(path), json={**body, **long, "stream": True}) as r:
                    events, done = parse_sse([line async for line in r.aiter_lines()])
                    return r.status_code, events, done

            cmpl = {"model": MODEL, "prompt": "doomed"}
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "doomed"}]}
            return await asyncio.gather(
                stream("/v1/completions", cmpl),  # these two run ...
                stream("/v1/completions", cmpl),
                http.post(server.url("/v1/completions"), json={**cmpl, **long}),  # ... these wait
                http.post(server.url("/v1/chat/completions"), json={**chat, **long}),
                stream("/v1/chat/completions", chat),
            )

    results = asyncio.run(run())
    streams = [results[0], results[1], results[4]]
    plain_cmpl, plain_chat = results[2], results[3]
    for status, events, done in streams:
        assert status == 200 and done, (status, events)
        error = events[-1]["error"]
        assert "injected fault" in error["message"] and error["type"] == "server_error"
        assert error["code"] == "engine_dead"
        assert not any(c.get("finish_reason") for e in events[:-1] for c in e["choices"])
    for r in (plain_cmpl, plain_chat):
        assert assert_openai_error(r, 500, "injected fault")["code"] == "engine_dead"

    health = httpx.get(server.url("/health"))
    assert assert_openai_error(health, 503, "engine")["code"] == "engine_dead"
    try:  # the process lingers a moment so clients can read their errors; new work is refused
        r = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": "late"}, timeout=5)
        assert assert_openai_error(r, 503, "engine")["code"] == "engine_dead"
    except httpx.TransportError:
        pass  # already gone
    t0 = time.monotonic()
    assert server.proc.wait(timeout=30) == 1
    assert time.monotonic() - t0 < 10
