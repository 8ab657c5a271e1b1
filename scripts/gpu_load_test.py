"""Load test of the OpenAI server (issue 18): N concurrent streaming clients for a fixed time, a share
of them leaving mid-stream; afterwards no request lost or duplicated, every KV block back, TTFT.

    python3 scripts/gpu_load_test.py                      # starts the server: Qwen3-0.6B shape, dummy weights
    python3 scripts/gpu_load_test.py --base-url http://127.0.0.1:8000   # against a running server

Defaults: 2,000 clients for 60 s, 10% of requests disconnect after a random number of tokens, each
request a random 128-token prompt (token ids: the preset has no tokenizer, the server runs with
--skip-tokenizer-init) and 16-128 output tokens (ignore_eos). ~2.5 minutes on one H200 with the
server start. The client needs nothing but the standard library (raw HTTP/1.1 over asyncio streams,
one keep-alive connection per client); the server needs fastapi, starlette, pydantic, uvicorn, h11,
anyio, msgspec and prometheus-client importable (PYTHONPATH).

Checks, each printed PASS / FAIL in the table at the end (exit status 1 on any FAIL):
- every request that was not disconnected got status 200, exactly max_tokens token ids in order of
  arrival, one finish_reason "length", usage.completion_tokens == max_tokens, its own id, and [DONE];
- the server's counters agree: finished "length" == completed requests (+ the disconnects that
  raced their last token), finished "abort" == the rest of the disconnects;
- after the run: 0 running, 0 waiting, KV cache usage 0 (every block back).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Tally:
    sent: int = 0
    completed: int = 0
    disconnected: int = 0
    refused: int = 0  # 503
    errors: list[str] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    ids_seen: set[str] = field(default_factory=set)
    duplicated_ids: int = 0

    def fail(self, msg: str) -> None:
        if len(self.errors) < 20:
            self.errors.append(msg)
        else:
            self.errors[-1] = f"... and more ({msg})"


class Conn:
    """One keep-alive HTTP/1.1 connection: POST a JSON body, read a chunked SSE answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()  # leave at once, as a client that crashed or gave up
        self.reader = self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[str, str]]:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), len(body), body)
        )
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        return status, headers

    async def chunks(self, headers: dict[str, str]):
        """The response body, piece by piece (chunked or Content-Length)."""
        assert self.reader is not None
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await self.reader.readline()).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readline()
                    return
                data = await self.reader.readexactly(size + 2)
                yield data[:-2]
        else:
            yield await self.reader.readexactly(int(headers.get("content-length", "0")))


async def one_request(conn: Conn, args: argparse.Namespace, rng: random.Random, rid: str, tally: Tally) -> None:
    max_tokens = rng.randint(args.min_tokens, args.max_tokens)
    leave_after = rng.randint(1, max_tokens - 1) if rng.random() < args.disconnect_frac else None
    body = json.dumps({
        "model": args.model, "prompt": [rng.randrange(100, 30000) for _ in range(args.prompt_len)],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}, "request_id": rid, "temperature": 0.0,
    }).encode()
    tally.sent += 1
    start = time.monotonic()
    status, headers = await conn.post("/v1/completions", body)
    if status == 503:
        tally.refused += 1
        async for _ in conn.chunks(headers):
            pass
        return
    if status != 200:
        text = b"".join([c async for c in conn.chunks(headers)])
        tally.fail(f"{rid}: status {status}: {text[:200]!r}")
        conn.close()
        return
    tokens = 0
    finishes: list[str] = []
    usage = None
    done = False
    buf = b""
    async for piece in conn.chunks(headers):
        buf += piece
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            if data == b"[DONE]":
                done = True
                continue
            msg = json.loads(data)
            if "error" in msg:
                tally.fail(f"{rid}: in-band error {msg['error']}")
                continue
            if msg["id"] != f"cmpl-{rid}":
                tally.fail(f"{rid}: got a chunk of {msg['id']}")
            for c in msg["choices"]:
                if c.get("token_ids"):
                    if tokens == 0:
                        tally.ttft.append(time.monotonic() - start)
                    tokens += len(c["token_ids"])
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
            if msg.get("usage") and not msg["choices"]:
                usage = msg["usage"]
            if leave_after is not None and tokens >= leave_after:
                tally.disconnected += 1
                conn.close()
                return
    if rid in tally.ids_seen:
        tally.duplicated_ids += 1
    tally.ids_seen.add(rid)
    ok = done and tokens == max_tokens and finishes == ["length"] and usage is not None \
        and usage["completion_tokens"] == max_tokens
    if ok:
        tally.completed += 1
    else:
        tally.fail(f"{rid}: done={done} tokens={tokens}/{max_tokens} finishes={finishes} usage={usage}")
    if headers.get("connection", "").lower() == "close":
        conn.close()


async def client(i: int, args: argparse.Namespace, deadline: float, tally: Tally) -> None:
    rng = random.Random(args.seed * 100_003 + i)
    conn = Conn(args.host, args.port)
    seq = 0
    await asyncio.sleep(rng.random() * args.ramp_s)  # spread the first requests over the ramp
    while time.monotonic() < deadline:
        rid = f"load-{i}-{seq}"
        seq += 1
        try:
            await one_request(conn, args, rng, rid, tally)
        except (ConnectionError, asyncio.IncompleteReadError, OSError, ValueError) as e:
            tally.fail(f"{rid}: {type(e).__name__}: {e}")
            conn.close()
            await asyncio.sleep(0.1)
    conn.close()


def scrape(base: str) -> dict[str, float]:
    """{name{labels}: value} of /metrics, with either prefix (pagedllm: or vllm:) folded to `x:`."""
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        name = "x:" + name.split(":", 1)[-1]
        labels = ",".join(p for p in labels.rstrip("}").split(",") if p and not p.startswith("model_name"))
        k = f"{name}{{{labels}}}" if labels else name
        out[k] = out.get(k, 0.0) + float(value)
    return out


def start_server(args: argparse.Namespace) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", args.model_path,
           "--served-model-name", args.model, "--load-format", "dummy", "--skip-tokenizer-init",
           "--host", args.host, "--port", str(args.port), "--max-model-len", "2048",
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-queued-reqs", str(2 * args.num_clients),
           "--limit-concurrency", str(2 * args.num_clients + 100), "--disable-log-requests",
           "--disable-uvicorn-access-log", *args.server_arg]
    log = open(args.server_log, "w")  # noqa: SIM115 - lives as long as the server
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {args.server_log}")
        try:
            if urllib.request.urlopen(f"http://{args.host}:{args.port}/health", timeout=1).status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not healthy after {args.start_timeout} s; see {args.server_log}")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server; else one is started")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8321)
    p.add_argument("--model", default="qwen3-0.6b", help="the served model name")
    p.add_argument("--model-path", default="qwen3-0.6b", help="--model of the started server (a preset)")
    p.add_argument("--num-clients", type=int, default=2000)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--ramp-s", type=float, default=5.0)
    p.add_argument("--disconnect-frac", type=float, default=0.1)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--min-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180)
    p.add_argument("--server-log", default="/tmp/gpu_load_test_server.log")
    p.add_argument("--server-arg", action="append", default=[], help="extra server flag (repeatable)")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 65536) if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))  # the server inherits it too
    proc = None
    if args.base_url:
        host_port = args.base_url.split("//", 1)[-1].rstrip("/")
        args.host, _, port = host_port.partition(":")
        args.port = int(port or 80)
    else:
        t = time.monotonic()
        proc = start_server(args)
        print(f"server ready in {time.monotonic() - t:.0f} s", flush=True)
    base = f"http://{args.host}:{args.port}"
    try:
        before = scrape(base)
        tally = Tally()
        t0 = time.monotonic()

        async def run() -> None:
            deadline = time.monotonic() + args.duration
            await asyncio.gather(*(client(i, args, deadline, tally) for i in range(args.num_clients)))

        asyncio.run(run())
        wall = time.monotonic() - t0
        idle = False
        for _ in range(100):  # the engine frees aborted requests before its next step
            after = scrape(base)
            if after.get("x:num_requests_running") == 0 and after.get("x:num_requests_waiting") == 0 \
                    and after.get("x:kv_cache_usage_perc") == 0:
                idle = True
                break
            time.sleep(0.1)

        def delta(key: str) -> float:
            return after.get(key, 0.0) - before.get(key, 0.0)

        length = delta('x:request_success_total{finished_reason="length"}')
        abort = delta('x:request_success_total{finished_reason="abort"}')
        gen = delta("x:generation_tokens_total")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    checks = [
        ("every kept request answered in full", not tally.errors and tally.completed > 0),
        ("no request id answered twice", tally.duplicated_ids == 0),
        ("no 503 (admission sized for the clients)", tally.refused == 0),
        ("server 'length' == completed (+ racing disconnects)",
         tally.completed <= length <= tally.completed + tally.disconnected),
        ("server 'abort' + 'length' == completed + disconnected", length + abort == tally.completed + tally.disconnected),
        ("idle after: 0 running, 0 waiting, every KV block back", idle),
    ]
    for e in tally.errors:
        print("error:", e)
    print()
    print(f"| {'measure':<52} | {'value':>12} |")
    print(f"|{'-' * 54}|{'-' * 14}|")
    rows = [
        ("clients", args.num_clients), ("seconds of load (wall)", f"{wall:.1f}"), ("requests sent", tally.sent),
        ("completed in full", tally.completed), ("disconnected mid-stream (by the client)", tally.disconnected),
        ("refused (503)", tally.refused), ("server finished 'length'", int(length)),
        ("server finished 'abort'", int(abort)), ("generation tokens (server)", int(gen)),
        ("output tokens / s (server)", f"{gen / wall:.0f}"),
        ("TTFT p50 (s)", f"{pct(tally.ttft, 50):.3f}"), ("TTFT p99 (s)", f"{pct(tally.ttft, 99):.3f}"),
    ]
    for name, value in rows:
        print(f"| {name:<52} | {value!s:>12} |")
    for name, ok in checks:
        print(f"| {name:<52} | {'PASS' if ok else 'FAIL':>12} |")
    sys.exit(0 if all(ok for _, ok in checks) else 1)


if __name__ == "__main__":
    main()
