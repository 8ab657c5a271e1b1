"""A disconnect storm: clients that leave while queued, during their prefill, mid-stream, while a
non-streaming answer is computed, and one that keeps its connection but stops reading. Afterwards
0 running, 0 waiting, a fully free KV pool, no request ran to its end, and the server answers
normally."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from tests.reliability.conftest import MODEL, assert_idle

LONG = 1500  # max_tokens no dropped request may reach
FLAGS = ["--max-model-len", "2048", "--num-gpu-blocks-override", "1024", "--max-num-seqs", "5",
         "--max-num-batched-tokens", "32", "--stream-write-timeout", "1"]
NORMAL = {"model": MODEL, "prompt": "Still there?", "max_tokens": 8, "temperature": 0}


def stream_body(prompt: str | list[int], max_tokens: int = LONG) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}


async def wait_metrics(server, cond, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = await asyncio.to_thread(server.metrics)
        if cond(m) or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.02)


def running(m: dict) -> float:
    return m[("vllm:num_requests_running", ())]


def waiting(m: dict) -> float:
    return m[("vllm:num_requests_waiting", ())]


def _success_name(m: dict) -> str:
    """vLLM's name once the metrics carry it (issue 17), else ours."""
    return next((n for n in ("vllm:request_success_total", "pagedllm:request_success_total")
                 if any(name == n for name, _ in m)), "pagedllm:request_success_total")


def successes(m: dict) -> float:
    """Requests that ran to their end (stop or length)."""
    name = _success_name(m)
    return sum(v for (n, labels), v in m.items() if n == name and labels != (("finished_reason", "abort"),))


def aborts(m: dict) -> float:
    return m.get((_success_name(m), (("finished_reason", "abort"),)), 0.0)


# Started by the package's server pool beside the next server it needs.
SERVERS = {"disconnects": (FLAGS, {})}


@pytest.fixture(scope="module")
def server(server_pool):
    return server_pool.take("disconnects", __name__)


def test_disconnect_storm_frees_everything(server):
    assert_idle(server)
    reference = server.post("/v1/completions", NORMAL).json()["choices"][0]["text"]
    before = server.metrics()
    seen: dict[str, object] = {}

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as http:
            url = server.url("/v1/completions")
            drop_hogs = asyncio.Event()
            drop_rest = asyncio.Event()

            async def hog(i: int) -> int:
                """Streams until told to leave (mid-stream), holding a running slot."""
                chunks = 0
                async with http.stream("POST", url, json=stream_body(f"hog {i}")) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: {")
                        if drop_hogs.is_set() and chunks >= 3:
                            break
                return chunks

            async def leave_before_first_token(body: dict, name: str) -> None:
                async with http.stream("POST", url, json=body) as r:
                    assert r.status_code == 200
                    lines = r.aiter_lines()
                    first = asyncio.ensure_future(lines.__anext__())
                    done, _ = await asyncio.wait({first, asyncio.ensure_future(drop_rest.wait())},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    seen[name] = first in done  # True would mean a token came before we left
                    first.cancel()

            async def leave_non_stream() -> None:
                body = {"model": MODEL, "prompt": "non-stream", "max_tokens": LONG, "ignore_eos": True}
                task = asyncio.ensure_future(http.post(url, json=body))
                await drop_rest.wait()
                task.cancel()

            hogs = [asyncio.create_task(hog(i)) for i in range(4)]
            m = await wait_metrics(server, lambda m: running(m) == 4)
            assert running(m) == 4
            # A long prompt: 1800 tokens at 28 a step (32 minus the hogs' decodes) is ~64 prefill steps.
            prefill = asyncio.create_task(leave_before_first_token(stream_body([7] * 1800, 4), "prefill"))
            m = await wait_metrics(server, lambda m: running(m) == 5)
            seen["prefill_running"] = running(m)
            queued = [asyncio.create_task(leave_before_first_token(stream_body(f"queued {i}", 50), f"queued{i}"))
                      for i in range(6)]
            non_stream = asyncio.create_task(leave_non_stream())
            m = await wait_metrics(server, lambda m: waiting(m) == 7)
            seen["waiting"] = waiting(m)
            drop_rest.set()  # queued, in prefill and non-streaming clients leave together
            await asyncio.gather(prefill, *queued, non_stream)
            drop_hogs.set()  # then the mid-stream ones
            seen["hog_chunks"] = await asyncio.gather(*hogs)

    asyncio.run(run())
    assert seen["prefill_running"] == 5 and seen["waiting"] == 7, seen
    assert seen["prefill"] is False, "the prefill client got a token before it left; make its prompt longer"
    assert not any(seen[f"queued{i}"] for i in range(6)), seen
    assert all(c >= 3 for c in seen["hog_chunks"]), seen
    m = assert_idle(server)
    assert successes(m) == successes(before)  # every dropped request was aborted, none finished
    # ... and counted as aborted (issue 18): 4 hogs, 1 in prefill, 6 queued, 1 non-streaming.
    assert aborts(m) - aborts(before) == 12
    made = m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())]
    assert made < LONG  # 5 long requests were cut short, far before LONG tokens each
    assert server.post("/v1/completions", NORMAL).json()["choices"][0]["text"] == reference


def test_a_client_that_stops_reading_is_dropped(server):
    """The client keeps its connection open and reads nothing. Once the socket buffers are full (the
    kernel takes a few MB, so the answer is made large: chat, n=5, 20 top logprobs per token) and a
    send makes no progress for --stream-write-timeout (1 s), the request is aborted and the
    connection reset."""
    assert_idle(server)
    before = server.metrics()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "never read"}], "max_tokens": LONG,
                       "ignore_eos": True, "stream": True, "n": 5, "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # small, so the stall comes soon
    sock.connect(("127.0.0.1", server.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        deadline = time.monotonic() + 60
        while "stopped reading" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "stopped reading" in server.log(), server.log()[-3000:]
        m = assert_idle(server)
        # The server reset the connection, dropping the megabytes queued for us: reading now gets at
        # most what already sat in our small receive buffer (a graceful close would deliver them all).
        sock.settimeout(10)
        received = 0
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        assert received < 256 * 1024, received
    finally:
        sock.close()
    made = m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())]
    assert successes(m) == successes(before)  # aborted, not finished
    assert aborts(m) - aborts(before) == 5  # n=5: five sequences
    assert 0 < made < 5 * LONG / 2
    assert server.post("/v1/completions", NORMAL).status_code == 200
