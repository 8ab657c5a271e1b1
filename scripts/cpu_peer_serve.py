"""pagedllm serve beside llama.cpp's llama-server on the CPU, alternating, streamed and not streamed.

Both servers must already run (BENCHMARKS.md's CPU section has their commands), e.g.

    llama-server -m SmolLM2-135M-Instruct.Q4_1.gguf --host 127.0.0.1 --port 8090 -np 16 -c 32768 -t 2 -tb 2
    pagedllm serve --port 8091
    python scripts/cpu_peer_serve.py --server pagedllm=http://127.0.0.1:8091 \
        --server llama-server=http://127.0.0.1:8090 --reps 3

Each repetition runs every setting on every server in turn (the servers alternate within a setting):
1 stream (4 requests in turn) streamed and not streamed, 16 concurrent (32 requests) streamed and not
streamed; prompts of 32 random token ids (seed 0, ids < 10000), 128 new tokens, greedy, ignore_eos:
`pagedllm bench serve --dataset-name random --input-len 32 --output-len 128 --random-token-max 10000
--seed 0`. tok/s = output tokens / wall time of the run (prefill included). The last lines are a table
of medians and the ratios to the last --server; every run prints the 1-minute load average beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

from pagedllm.benchmarks import serve

SETTINGS = (("1 stream, streamed", 1, 4, True), ("1 stream, not streamed", 1, 4, False),
            ("16 concurrent, streamed", 16, 32, True), ("16 concurrent, not streamed", 16, 32, False))


def _args(base: str, model: str, concurrency: int, n: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_cli_args(p)
    return p.parse_args(["--base-url", base, "--model", model, "--dataset-name", "random", "--input-len", "32",
                         "--output-len", "128", "--random-token-max", "10000", "--seed", "0", "--num-prompts",
                         str(n), "--max-concurrency", str(concurrency), "--disable-tqdm"])


async def _not_streamed(args: argparse.Namespace, requests: list[serve.ServeRequest]) -> tuple[int, float]:
    import httpx

    url = args.base_url.rstrip("/") + args.endpoint
    sem = asyncio.Semaphore(args.max_concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(
            max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency)) as client:
        warm = dict(serve.make_payload(requests[0], args, False), stream=False, max_tokens=8)
        warm.pop("stream_options")
        (await client.post(url, json=warm)).raise_for_status()

        async def one(req: serve.ServeRequest) -> int:
            body = dict(serve.make_payload(req, args, False), stream=False)
            body.pop("stream_options")
            async with sem:
                r = await client.post(url, json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(r) for r in requests))
        return sum(tokens), time.perf_counter() - t0


def run(base: str, model: str, concurrency: int, n: int, streamed: bool) -> float:
    args = _args(base, model, concurrency, n)
    requests = serve.build_requests(serve.requests_from_args(args), None)
    if streamed:
        outputs, duration = asyncio.run(serve.benchmark(args, requests))
        m = serve.calculate_metrics(outputs, duration, [])
        if m["failed"]:
            raise RuntimeError(f"{base}: {m['failed']} requests failed")
        return m["total_output_tokens"] / duration
    tokens, duration = asyncio.run(_not_streamed(args, requests))
    return tokens / duration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", required=True, help="NAME=BASE_URL; the last is the peer")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name sent (llama-server ignores it)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", default="0,1,2,3", help="indices into SETTINGS to run")
    a = ap.parse_args()
    servers = [s.split("=", 1) for s in a.server]
    chosen = [SETTINGS[int(i)] for i in a.settings.split(",")]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rep in range(a.reps):
        for label, conc, n, streamed in chosen:
            order = servers if rep % 2 == 0 else servers[::-1]
            for name, base in order:
                tps = run(base, a.model, conc, n, streamed)
                load = os.getloadavg()[0]
                results.setdefault((label, name), []).append((tps, load))
                print(f"rep {rep + 1} {label:<28} {name:<14} {tps:7.1f} tok/s  load {load:.1f}", flush=True)
    peer = servers[-1][0]
    print(f"\n| setting | {' | '.join(n for n, _ in servers)} | ratio to {peer} |\n|---|"
          + "---|" * (len(servers) + 1))
    for label, *_ in chosen:
        meds = {n: statistics.median(t for t, _ in results[(label, n)]) for n, _ in servers}
        cells = [f"{meds[n]:.1f} ({' / '.join(f'{t:.0f}@{ld:.1f}' for t, ld in results[(label, n)])})"
                 for n, _ in servers]
        ratios = " / ".join(f"{meds[n] / meds[peer]:.2f}x" for n, _ in servers[:-1])
        print(f"| {label} | {' | '.join(cells)} | {ratios} |")


if __name__ == "__main__":
    main()
