"""SIGTERM with requests in flight: new requests get 503 at once (and /health says so), the requests in
flight finish within --shutdown-timeout, and the process exits 0. Past the timeout, what is left ends
with a 503 error (an error event then [DONE] when streaming) and the process still exits 0."""

from __future__ import annotations

import asyncio
import signal
import time

import httpx

from tests.reliability.conftest import MODEL, assert_openai_error, parse_sse

FLAGS = ["--max-model-len", "2048", "--num-gpu-blocks-override", "1024", "--max-num-seqs", "8"]


async def wait_until(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def run_with_sigterm(server, max_tokens: int) -> dict:
    """3 streams and 2 non-streaming requests; SIGTERM once they all run; then probe the server."""
    out: dict = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            url = server.url("/v1/completions")
            body = {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True}
            started = [asyncio.Event() for _ in range(3)]

            async def stream(i: int):
                async with http.stream("POST", url, json={**body, "stream": True}) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        lines.append(line)
                        if line.startswith("data: {"):
                            started[i].set()
                    return r.status_code, *parse_sse(lines)

            tasks = [asyncio.create_task(stream(i)) for i in range(3)]
            tasks += [asyncio.create_task(http.post(url, json=body)) for _ in range(2)]

            async def all_running() -> bool:
                m = await asyncio.to_thread(server.metrics)
                return m[("vllm:num_requests_running", ())] == 5 and all(e.is_set() for e in started)

            assert await wait_until(all_running)
            server.proc.send_signal(signal.SIGTERM)
            out["sigterm_at"] = time.monotonic()

            async def draining() -> bool:
                return (await http.get(server.url("/health"))).status_code == 503

            assert await wait_until(draining, 5)
            out["health"] = await http.get(server.url("/health"))
            out["late"] = await http.post(url, json={**body, "max_tokens": 2})
            out["late_models"] = await http.get(server.url("/v1/models"))
            out["metrics"] = await asyncio.to_thread(server.metrics)  # /metrics stays open while draining
            results = await asyncio.gather(*tasks)
            out["streams"], out["plain"] = results[:3], results[3:]

    asyncio.run(run())
    out["exit_code"] = server.proc.wait(timeout=60)
    out["exit_after"] = time.monotonic() - out["sigterm_at"]
    return out


def test_sigterm_lets_running_requests_finish_then_exits_0(start_server):
    server = start_server([*FLAGS, "--shutdown-timeout", "30"])
    out = run_with_sigterm(server, max_tokens=150)
    assert assert_openai_error(out["health"], 503, "shutting down")["code"] == "server_shutting_down"
    assert assert_openai_error(out["late"], 503, "shutting down")["code"] == "server_shutting_down"
    assert out["late"].headers["connection"] == "close"
    assert_openai_error(out["late_models"], 503, "shutting down")
    assert out["metrics"][("pagedllm:request_rejected_total", (("reason", "shutting_down"),))] == 2
    assert out["metrics"][("pagedllm:num_admitted_seqs", ())] == 5
    for status, events, done in out["streams"]:
        assert status == 200 and done
        assert all("error" not in e for e in events)
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
        assert sum(len(c["text"]) > 0 for e in events for c in e["choices"]) > 0
    for r in out["plain"]:
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["completion_tokens"] == 150
    assert out["exit_code"] == 0, server.log()[-2000:]
    assert out["exit_after"] < 30
    assert "drained: every request finished" in server.log()


def test_sigterm_past_the_timeout_ends_the_rest_with_an_error_and_exits_0(start_server):
    server = start_server([*FLAGS, "--shutdown-timeout", "1"])
    # 1900 tokens cannot be made in 1 s on a CPU
    out = run_with_sigterm(server, max_tokens=1900)
    for status, events, done in out["streams"]:
        assert status == 200 and done
        error = events[-1]["error"]
        assert error["code"] == "server_shutting_down" and "--shutdown-timeout" in error["message"]
    for r in out["plain"]:
        assert assert_openai_error(r, 503, "--shutdown-timeout")["code"] == "server_shutting_down"
    assert out["exit_code"] == 0, server.log()[-2000:]
    assert out["exit_after"] < 1 + 10
    assert "shutdown timeout: ending 5 requests" in server.log()
