"""500 concurrent streaming requests against a server that admits at most 2 running + 2 queued
sequences: every request either streams exactly the right text (one finish_reason, usage, [DONE])
or gets 503 with Retry-After at once. None is lost, none duplicated, and the server's counters
show that refused requests never reached the engine."""

from __future__ import annotations

import asyncio
import time

import httpx

from tests.reliability.conftest import MODEL, assert_idle, assert_openai_error, parse_sse

NUM_CLIENTS = 500
MAX_NUM_SEQS = 2  # LOW_LIMITS
MAX_QUEUED = 2
PROMPTS = [f"Load test prompt {i}: tell me about topic {i * 3}" for i in range(10)]
MAX_TOKENS = 6


def test_500_concurrent_streams_complete_or_get_503(low_limits_server):
    server = low_limits_server
    before = assert_idle(server)

    async def run() -> tuple[list[dict], list[tuple[str, object]]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 10, max_keepalive_connections=NUM_CLIENTS + 10)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            expected = []
            for p in PROMPTS:  # one at a time: the reference answers
                r = await http.post(server.url("/v1/completions"),
                                    json={"model": MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0})
                expected.append({"text": r.json()["choices"][0]["text"], "usage": r.json()["usage"]})

            start = asyncio.Event()

            async def client(i: int) -> tuple[str, object]:
                body = {"model": MODEL, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": MAX_TOKENS,
                        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
                await start.wait()
                t0 = time.monotonic()
                try:
                    async with http.stream("POST", server.url("/v1/completions"), json=body) as r:
                        if r.status_code == 503:
                            await r.aread()
                            return "refused", r
                        assert r.status_code == 200, (r.status_code, await r.aread())
                        events, done = parse_sse([line async for line in r.aiter_lines()])
                        return "streamed", (events, done)
                except httpx.TransportError as e:  # a lost request: reported below with when and the server's log
                    return "lost", f"client {i}: {e!r} after {time.monotonic() - t0:.2f} s"

            tasks = [asyncio.create_task(client(i)) for i in range(NUM_CLIENTS)]
            await asyncio.sleep(0.2)
            start.set()  # all at once
            return expected, await asyncio.gather(*tasks)

    expected, results = asyncio.run(run())
    assert len({e["text"] for e in expected}) > 1
    lost = [payload for kind, payload in results if kind == "lost"]
    assert not lost, f"{len(lost)} of {NUM_CLIENTS} requests lost their connection: {lost[:5]}\n" + server.log()[-6000:]

    completed = refused = prompt_tokens = completion_tokens = 0
    ids = set()
    for i, (kind, payload) in enumerate(results):
        if kind == "refused":
            refused += 1
            err = assert_openai_error(payload, 503, "--max-num-queued-reqs")
            assert err["code"] == "server_overloaded"
            assert int(payload.headers["Retry-After"]) >= 1
            continue
        events, done = payload
        assert done, f"client {i}: the stream did not end with [DONE]"
        assert all("error" not in e for e in events), events
        text = "".join(c["text"] for e in events for c in e["choices"])
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert text == expected[i % len(PROMPTS)]["text"], f"client {i} got the wrong text"
        assert len(finishes) == 1, finishes
        assert len({e["id"] for e in events}) == 1
        ids.add(events[0]["id"])
        usage = events[-1]["usage"]
        assert events[-1]["choices"] == [] and usage["completion_tokens"] <= MAX_TOKENS
        prompt_tokens += usage["prompt_tokens"]
        completion_tokens += usage["completion_tokens"]
        completed += 1

    assert completed + refused == NUM_CLIENTS
    assert len(ids) == completed  # no answer delivered twice
    assert completed >= MAX_NUM_SEQS + MAX_QUEUED and refused > 0, (completed, refused)

    m = assert_idle(server)

    def delta(name: str, *labels: tuple[str, str]) -> float:
        return m[(name, tuple(labels))] - before.get((name, tuple(labels)), 0.0)

    # The engine served exactly the completed requests (+ the 10 references), nothing else.
    finished = delta("vllm:request_success_total", ("finished_reason", "length")) + delta(
        "vllm:request_success_total", ("finished_reason", "stop")
    )
    assert finished == completed + len(PROMPTS)
    assert delta("vllm:request_success_total", ("finished_reason", "abort")) == 0
    assert delta("pagedllm:request_rejected_total", ("reason", "queue_full")) == refused
    assert m[("pagedllm:num_admitted_seqs", ())] == 0
    ref_prompt = sum(e["usage"]["prompt_tokens"] for e in expected)
    ref_completion = sum(e["usage"]["completion_tokens"] for e in expected)
    assert delta("vllm:prompt_tokens_total") == prompt_tokens + ref_prompt
    assert delta("vllm:generation_tokens_total") == completion_tokens + ref_completion
    # the server still answers normally
    r = server.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                        "temperature": 0})
    assert r.json()["choices"][0]["text"] == expected[0]["text"]
