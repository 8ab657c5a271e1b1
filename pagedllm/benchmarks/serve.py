"""`pagedllm bench serve`: a load generator against any OpenAI-compatible server (ours or vLLM's).

    pagedllm bench serve --base-url http://127.0.0.1:8000 --model qwen3-0.6b --dataset random \\
        --input-len 1024 --output-len 128 --num-prompts 200 --request-rate 8 --max-concurrency 64

Requests stream (`"stream": true`); per request it records the time to the first token (TTFT), the
gaps between streamed chunks (inter-token latency, ITL), and time per output token after the first,
TPOT = (latency - TTFT) / (output tokens - 1). Arrivals are a Poisson process of `--request-rate`
requests/s (gamma-distributed gaps with `--burstiness` != 1, as vLLM), all at once when `inf`;
`--max-concurrency` caps the requests in flight.

Prompts are token-id lists (`"prompt": [ids]`, /v1/completions only) unless `--tokenizer` is given,
then text decoded from the same random ids (vLLM's random dataset does this). Output tokens are read
from the final `usage` chunk (`stream_options.include_usage`), else counted from the chunks'
`token_ids` (`return_token_ids`), else one per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import pagedllm.envs as envs
from pagedllm.benchmarks.datasets import SampleRequest, add_dataset_args, requests_from_args


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument(
        "--base-url", default=None, help="server URL, e.g. http://127.0.0.1:8000 (else --host/--port)"
    )
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    g.add_argument("--model", required=True, help="the served model name sent in each request")
    g.add_argument("--tokenizer", default=None, help="local tokenizer dir or .gguf: send text prompts")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token (default: $OPENAI_API_KEY if set)")
    add_dataset_args(parser, default_input_len=1024, default_output_len=128, default_num_prompts=1000)
    parser.add_argument("--seed", type=int, default=0)
    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf: all at once"
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1: Poisson")
    g.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on; vLLM's flag, default off there)",
    )
    g.add_argument(
        "--return-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for token ids in the stream, so a server without a tokenizer still streams",
    )
    g.add_argument("--metric-percentiles", default="90,99", help="percentiles to report besides mean and median")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds, per request")
    g.add_argument(
        "--ready-check-timeout-sec",
        type=int,
        default=600,
        help="retry the first request this long while the server starts",
    )
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


@dataclass
class RequestFuncOutput:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds between successive chunks
    latency: float = 0.0
    generated_text: str = ""
    error: str = ""


@dataclass(frozen=True)
class ServeRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def build_requests(samples: list[SampleRequest], tokenizer: Any | None) -> list[ServeRequest]:
    if tokenizer is None:
        return [ServeRequest(s.prompt_token_ids, s.prompt_len, s.expected_output_len) for s in samples]
    out = []
    for s in samples:
        text = tokenizer.decode(s.prompt_token_ids, skip_special_tokens=True)
        out.append(
            ServeRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), s.expected_output_len)
        )
    return out


def make_payload(req: ServeRequest, args: argparse.Namespace, chat: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
        if args.return_token_ids:
            body["return_token_ids"] = True
    return body


def _chunk_delta(data: dict[str, Any], chat: bool) -> tuple[bool, str, int]:
    """(carries output, its text, its token count or 0 when unknown) for one streamed chunk."""
    choices = data.get("choices") or []
    if not choices:
        return False, "", 0
    c = choices[0]
    text = ((c.get("delta") or {}).get("content") if chat else c.get("text")) or ""
    ids = c.get("token_ids") or []
    # A final chunk that only carries finish_reason is no token.
    return bool(text or ids or c.get("finish_reason") is None), text, len(ids)


async def send_request(
    client: Any, url: str, headers: dict[str, str], req: ServeRequest, payload: dict[str, Any], chat: bool
) -> RequestFuncOutput:
    out = RequestFuncOutput(prompt_len=req.prompt_len)
    chunks, counted = 0, 0
    usage_tokens: int | None = None
    text: list[str] = []
    st = time.perf_counter()
    last = st
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:500]}"
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                body = line[5:].strip()
                if body == "[DONE]":
                    break
                data = json.loads(body)
                if "error" in data:
                    out.error = json.dumps(data["error"])[:500]
                    return out
                if data.get("usage"):
                    usage_tokens = data["usage"].get("completion_tokens")
                has_output, t, n = _chunk_delta(data, chat)
                if not has_output:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
                counted += n
                text.append(t)
        out.latency = time.perf_counter() - st
        out.generated_text = "".join(text)
        out.output_tokens = usage_tokens if usage_tokens is not None else (counted or chunks)
        out.success = chunks > 0
        if not out.success:
            out.error = "the stream carried no output"
    except Exception as e:  # a failed request is counted, never fatal to the run
        out.error = f"{type(e).__name__}: {e}"
    return out


async def _arrivals(n: int, rate: float, burstiness: float, seed: int):
    """Yield 0..n-1 with gamma(burstiness, 1 / (rate * burstiness)) gaps: Poisson when burstiness == 1."""
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(rng.gamma(burstiness, 1.0 / (rate * burstiness)))


async def wait_ready(
    client: Any,
    url: str,
    headers: dict[str, str],
    req: ServeRequest,
    payload: dict[str, Any],
    chat: bool,
    timeout: float,
) -> None:
    """One request first (vLLM does the same): retried while the server starts, fatal if it fails then."""
    deadline = time.monotonic() + timeout
    while True:
        out = await send_request(client, url, headers, req, payload, chat)
        if out.success:
            return
        if time.monotonic() > deadline or not out.error.startswith(
            ("ConnectError", "RemoteProtocolError", "HTTP 503")
        ):
            raise ValueError(f"the first request to {url} failed: {out.error}")
        await asyncio.sleep(0.5)


async def benchmark(
    args: argparse.Namespace, requests: list[ServeRequest]
) -> tuple[list[RequestFuncOutput], float]:
    try:
        import httpx
    except ImportError as e:  # httpx comes with the openai client and the test extra
        raise ValueError("`pagedllm bench serve` needs httpx: pip install httpx") from e

    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = base + args.endpoint
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if chat and not isinstance(requests[0].prompt, str):
        raise ValueError("chat endpoints take text: give --tokenizer to turn the random ids into text.")
    key = args.api_key or envs.OPENAI_API_KEY
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(
        max_connections=args.max_concurrency, max_keepalive_connections=args.max_concurrency
    )
    timeout = httpx.Timeout(args.request_timeout, connect=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        first = requests[0]
        warm = ServeRequest(first.prompt, first.prompt_len, min(first.output_len, 8))
        await wait_ready(
            client, url, headers, warm, make_payload(warm, args, chat), chat, args.ready_check_timeout_sec
        )
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(req: ServeRequest) -> RequestFuncOutput:
            payload = make_payload(req, args, chat)
            if sem is None:
                return await send_request(client, url, headers, req, payload, chat)
            async with sem:
                return await send_request(client, url, headers, req, payload, chat)

        t0 = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), args.request_rate, args.burstiness, args.seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        outputs = await asyncio.gather(*tasks)
        return list(outputs), time.perf_counter() - t0


def calculate_metrics(
    outputs: list[RequestFuncOutput], duration: float, percentiles: list[float]
) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    e2el = [o.latency for o in ok]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2el)):
        ms = np.asarray(values, dtype=float) * 1e3
        m[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else 0.0
        m[f"median_{name}_ms"] = float(np.median(ms)) if ms.size else 0.0
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else 0.0
    return m


_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def print_metrics(m: dict[str, Any], percentiles: list[float]) -> None:
    def row(label: str, value: Any) -> None:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    print("{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="))
    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name, title in _TITLES.items():
        print("{s:{c}^50}".format(s=f" {title} ", c="-"))
        key = name.upper()
        row(f"Mean {key} (ms):", m[f"mean_{name}_ms"])
        row(f"Median (P50) {key} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {key} (ms):", m[f"p{p:g}_{name}_ms"])
    print("=" * 50)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}.")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}.")
    tokenizer = None
    if args.tokenizer:
        from pagedllm.loader.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(args.tokenizer).expanduser())
    samples = requests_from_args(args)
    requests = build_requests(samples, tokenizer)
    outputs, duration = asyncio.run(benchmark(args, requests))
    m = calculate_metrics(outputs, duration, percentiles)
    print_metrics(m, percentiles)
    errors = sorted({o.error for o in outputs if not o.success})
    for e in errors[:5]:
        print(f"error: {e}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(
                {
                    **m,
                    "model": args.model,
                    "endpoint": args.endpoint,
                    "request_rate": args.request_rate,
                    "max_concurrency": args.max_concurrency,
                    "num_prompts": len(requests),
                    "input_lens": [o.prompt_len for o in outputs],
                    "output_lens": [o.output_tokens for o in outputs],
                    "ttfts": [o.ttft for o in outputs],
                    "itls": [o.itl for o in outputs],
                    "errors": [o.error for o in outputs],
                },
                f,
                indent=2,
            )
    return 0 if m["completed"] else 1
