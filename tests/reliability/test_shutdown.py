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
# One server per test (each ends its own), started two at a time by the package's server pool.
SERVERS = {
    "drain": ([*FLAGS, "--shutdown-timeout", "30"], {}),
    "timeout": ([*FLAGS, "--shutdown-timeout", "1"], {}),
    "sighup": ([*FLAGS, "--shutdown-timeout", "30"], {}),
    "second-sigterm": ([*FLAGS, "--shutdown-timeout", "30"], {}),
}


async def wait_until(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not await pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def start_in_flight(http: httpx.AsyncClient, server, body: dict) -> list[asyncio.Task]:
    """3 streams and 2 non-streaming requests of `body`, returned once all 5 run (each stream has its
    first chunk): the streams' tasks give (status, events, done), the others the responses."""
    url = server.url("/v1/completions")
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
        running = m.get(("vllm:num_requests_running", ()), m.get(("pagedllm:num_requests_running", ())))
        return running == 5 and all(e.is_set() for e in started)

    assert await wait_until(all_running)
    return tasks


async def wait_draining(http: httpx.AsyncClient, server) -> bool:
    """Whether /health turns 503 (the server is draining) within 5 s."""
    async def draining() -> bool:
        return (await http.get(server.url("/health"))).status_code == 503

    return await wait_until(draining, 5)


def run_with_sigterm(server, max_tokens: int) -> dict:
    """3 streams and 2 non-streaming requests; SIGTERM once they all run; then probe the server."""
    out: dict = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            url = server.url("/v1/completions")
            body = {"model": MODEL, "prompt": "drain me", "max_tokens": max_tokens, "ignore_eos": True}
            tasks = await start_in_flight(http, server, body)
            server.proc.send_signal(signal.SIGTERM)
            out["sigterm_at"] = time.monotonic()
            assert await wait_draining(http, server)
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


def test_sigterm_lets_running_requests_finish_then_exits_0(server_pool):
    server = server_pool.take("drain", __name__)
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


def test_sigterm_past_the_timeout_ends_the_rest_with_an_error_and_exits_0(server_pool):
    server = server_pool.take("timeout", __name__)
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


def run_and_stop_now(server, signals: list[signal.Signals]) -> dict:
    """3 streams and 2 non-streaming requests that cannot finish soon; once they all run, send the
    signals (waiting for the drain to show between two of them)."""
    out: dict = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": MODEL, "prompt": "stop me", "max_tokens": 1900, "ignore_eos": True}
            tasks = await start_in_flight(http, server, body)
            for i, sig in enumerate(signals):
                if i:
                    assert await wait_draining(http, server)
                server.proc.send_signal(sig)
            out["signal_at"] = time.monotonic()
            results = await asyncio.gather(*tasks)
            out["streams"], out["plain"] = results[:3], results[3:]

    asyncio.run(run())
    out["exit_code"] = server.proc.wait(timeout=60)
    out["exit_after"] = time.monotonic() - out["signal_at"]
    return out


def check_stopped_now(server, out: dict, signal_name: str) -> None:
    for status, events, done in out["streams"]:
        assert status == 200 and done, (status, events[-1:], done)  # an error event, then [DONE]
        error = events[-1]["error"]
        assert error["code"] == "server_shutting_down" and signal_name in error["message"], error
    for r in out["plain"]:
        assert assert_openai_error(r, 503, signal_name)["code"] == "server_shutting_down"
    assert out["exit_code"] == 0, server.log()[-2000:]
    assert out["exit_after"] < 15
    log = server.log()
    assert f"{signal_name}: ending 5 requests in flight (5 engine requests" in log, log[-2000:]
    assert f"{signal_name}: every request in flight was sent its error" in log
    assert "drained: every request finished" not in log


def test_sighup_ends_every_stream_with_an_error_event(server_pool):
    """SIGHUP used to kill the process at once: every stream cut with no error event, no [DONE]."""
    server = server_pool.take("sighup", __name__)
    check_stopped_now(server, run_and_stop_now(server, [signal.SIGHUP]), "SIGHUP")


def test_a_second_sigterm_ends_every_stream_with_an_error_event(server_pool):
    """A second SIGTERM while draining used to cut the streams after uvicorn's grace with no error
    event, while the log said every request finished."""
    server = server_pool.take("second-sigterm", __name__)
    check_stopped_now(server, run_and_stop_now(server, [signal.SIGTERM, signal.SIGTERM]), "SIGTERM")
