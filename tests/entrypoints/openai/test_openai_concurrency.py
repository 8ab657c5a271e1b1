"""Many clients at once, clients that leave mid-request, and /metrics against what was served."""

from __future__ import annotations

import asyncio

import httpx

MODEL = "tiny"
PROMPTS = [f"Client {i} asks about topic number {i * 7 % 13}:" for i in range(64)]


def test_64_concurrent_streams_get_the_right_text(tiny_server):
    async def run() -> tuple[list[str], list[str], int]:
        client = tiny_server.async_client()

        async def full(p: str) -> str:
            r = await client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0)
            return r.choices[0].text

        async def stream(p: str) -> tuple[str, int]:
            s = await client.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True)
            text, finishes = "", 0
            async for c in s:
                for ch in c.choices:
                    text += ch.text
                    finishes += ch.finish_reason is not None
            return text, finishes

        expected = await asyncio.gather(*(full(p) for p in PROMPTS))
        got = await asyncio.gather(*(stream(p) for p in PROMPTS))
        await client.close()
        return expected, [t for t, _ in got], sum(f for _, f in got)

    expected, got, finishes = asyncio.run(run())
    assert len(set(expected)) > 1  # the prompts really differ
    assert got == expected
    assert finishes == 64
    m = tiny_server.wait_idle()
    assert m[("vllm:kv_cache_usage_perc", ())] == 0


def test_disconnecting_clients_free_everything(tiny_server):
    """20 streaming clients drop after a few chunks, one non-streaming client gives up while it
    waits: afterwards 0 running, 0 waiting, a fully free KV pool, and the requests did not run on."""
    before = tiny_server.metrics()
    max_tokens = 800

    async def run() -> int:
        headers = tiny_server.headers
        async with httpx.AsyncClient(timeout=30, headers=headers) as http:

            async def leave_mid_stream(i: int) -> int:
                body = {"model": MODEL, "prompt": f"disconnect {i}", "max_tokens": max_tokens, "ignore_eos": True,
                        "stream": True}
                seen = 0
                async with http.stream("POST", tiny_server.url("/v1/completions"), json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: {")
                        if seen == 3:
                            break  # leaving the block closes the connection
                return seen

            async def leave_while_waiting() -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": max_tokens,
                        "ignore_eos": True}
                try:
                    await asyncio.wait_for(http.post(tiny_server.url("/v1/chat/completions"), json=body), 0.5)
                except TimeoutError:
                    pass

            seen = await asyncio.gather(*(leave_mid_stream(i) for i in range(20)), leave_while_waiting())
            return sum(s for s in seen if s)

    assert asyncio.run(run()) == 60
    m = tiny_server.wait_idle(timeout=10)
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0
    # Aborted, not finished: no request reached max_tokens, far fewer tokens than 21 * 800 were made.
    key = ("vllm:request_success_total", (("finished_reason", "length"),))
    assert m[key] == before[key]
    made = m[("vllm:generation_tokens_total", ())] - before[("vllm:generation_tokens_total", ())]
    assert made < 21 * max_tokens / 4
    # and the server still answers
    assert tiny_server.client().completions.create(model=MODEL, prompt="still there?", max_tokens=3).usage


def test_metrics_count_what_was_served(tiny_server):
    client = tiny_server.client()
    before = tiny_server.wait_idle()
    served = {"prompt": 0, "completion": 0, "stop": 0, "length": 0}

    def count(usage, finish_reasons) -> None:
        served["prompt"] += usage.prompt_tokens
        served["completion"] += usage.completion_tokens
        for f in finish_reasons:
            served[f] += 1

    for r in (
        client.completions.create(model=MODEL, prompt="count me", max_tokens=7, temperature=0),
        client.completions.create(model=MODEL, prompt=["one", "two words"], max_tokens=5, n=2, seed=3),
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hey"}], max_tokens=9),
    ):
        count(r.usage, [c.finish_reason for c in r.choices])
    probe = client.completions.create(model=MODEL, prompt="stop test", max_tokens=20, temperature=0)
    count(probe.usage, [probe.choices[0].finish_reason])
    r = client.completions.create(
        model=MODEL, prompt="stop test", max_tokens=20, temperature=0, stop=probe.choices[0].text[6:9]
    )
    assert r.choices[0].finish_reason == "stop"
    count(r.usage, ["stop"])
    usage, reasons = None, []
    for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream"}], max_tokens=4, n=2, stream=True,
        stream_options={"include_usage": True},
    ):
        usage = c.usage or usage
        reasons += [ch.finish_reason for ch in c.choices if ch.finish_reason]
    count(usage, reasons)

    after = tiny_server.wait_idle()

    def delta(name: str, *labels: tuple[str, str]) -> float:
        return after[(name, tuple(labels))] - before[(name, tuple(labels))]

    assert delta("vllm:prompt_tokens_total") == served["prompt"]
    assert delta("vllm:generation_tokens_total") == served["completion"]
    assert delta("vllm:request_success_total", ("finished_reason", "stop")) == served["stop"]
    assert delta("vllm:request_success_total", ("finished_reason", "length")) == served["length"]
    sequences = served["stop"] + served["length"]  # one per choice
    assert sequences == 1 + 4 + 1 + 1 + 1 + 2
    assert delta("vllm:time_to_first_token_seconds_count") == sequences
    assert delta("vllm:e2e_request_latency_seconds_count") == sequences
    assert delta("vllm:request_queue_time_seconds_count") == sequences
    # every token after a sequence's first is one inter-token gap
    assert delta("vllm:inter_token_latency_seconds_count") == served["completion"] - sequences
    assert delta("vllm:prefix_cache_queries_total") > 0


def test_requests_of_one_request_id_run_side_by_side(tiny_server):
    """Two requests with the same request_id at once (a retry, a proxy's id): vLLM (0.14 on) gives each an
    engine id of its own; the second was refused, a 400 "already in use". Each answer keeps the id."""
    async def run() -> list:
        client = tiny_server.async_client()
        kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"request_id": "mine", "ignore_eos": True})
        done = await asyncio.gather(
            *(client.completions.create(prompt=PROMPTS[0], **kw) for _ in range(3)),
            client.completions.create(prompt=PROMPTS[:2], **kw),
            *(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **kw) for _ in range(2)),
        )
        await client.close()
        return done

    done = asyncio.run(run())
    assert [r.id for r in done] == ["cmpl-mine"] * 4 + ["chatcmpl-mine"] * 2
    assert len({r.choices[0].text for r in done[:3]}) == 1 and len(done[3].choices) == 2
    assert tiny_server.wait_idle()[("vllm:num_requests_running", ())] == 0
