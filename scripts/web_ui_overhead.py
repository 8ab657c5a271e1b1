"""What the web console costs: the CPU server's 16-stream throughput with the page open against
without, and (on a GPU) offline W1 with the engine mapping its KV pool as the console makes it do.

    python scripts/web_ui_overhead.py cpu [--reps 3]          # embedded SmolLM2 server, 16 streams
    python scripts/web_ui_overhead.py gpu --model qwen3-0.6b   # W1, kv snapshot every 1 s vs never

Runs alternate (without, with, with, without, ...) and the table shows every run and the medians.
The CPU mode also counts the CPU seconds each run costs the server's processes and the browser's
(psutil, the process trees): on a 2-core machine whose other jobs move wall-clock throughput by more
than the 2% the issue allows, the extra CPU per output token with the page open is the steadier
measure of what the page costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_cpu(root: psutil.Process, exclude: frozenset[int] = frozenset()) -> dict[int, float]:
    """User + system CPU seconds per live process of `root`'s tree (minus the `exclude` subtrees)."""
    procs = [root]
    try:
        procs += root.children(recursive=True)
    except psutil.Error:
        pass
    skip: set[int] = set()
    for pid in exclude:
        try:
            skip |= {pid} | {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:
            pass
    out = {}
    for p in procs:
        if p.pid not in skip:
            try:
                t = p.cpu_times()
                out[p.pid] = t.user + t.system
            except psutil.Error:
                pass
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two snapshots by the processes alive at the second one (a process that
    exited in between, e.g. a closed page's renderer, drops out instead of turning the sum negative)."""
    return sum(t - before.get(pid, 0.0) for pid, t in after.items())


def bench_serve(port: int, out: Path) -> float:
    cmd = [sys.executable, "-m", "pagedllm", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--model", MODEL, "--dataset-name", "random", "--input-len", "32", "--output-len", "128",
           "--random-token-max", "10000", "--num-prompts", "32", "--max-concurrency", "16", "--output-json", str(out)]
    subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_throughput"]


def cpu(reps: int) -> None:
    from playwright.sync_api import sync_playwright

    port = free_port()
    log = open(tempfile.mkstemp(suffix=".log")[1], "w")  # noqa: SIM115 - lives as long as the server
    server = subprocess.Popen([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                               "--port", str(port), "--disable-uvicorn-access-log"], env=ENV, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"server did not start; log: {log.name}")
            time.sleep(0.5)
        out = Path(tempfile.mkstemp(suffix=".json")[1])
        results: dict[str, list[float]] = {"closed": [], "open": []}
        cpu_per_tok: dict[str, list[float]] = {"closed": [], "open": []}
        srv, me = psutil.Process(server.pid), psutil.Process()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"])
            bench_serve(port, out)  # warm-up
            for rep in range(reps):
                for mode in (("closed", "open") if rep % 2 == 0 else ("open", "closed")):
                    page = None
                    if mode == "open":
                        page = browser.new_page()
                        page.goto(f"http://127.0.0.1:{port}/ui")
                        page.wait_for_selector("[data-testid=conn]:text('live')", timeout=30_000)
                    s0, b0 = tree_cpu(srv), tree_cpu(me, exclude=frozenset({server.pid}))
                    results[mode].append(bench_serve(port, out))
                    s1, b1 = tree_cpu(srv), tree_cpu(me, exclude=frozenset({server.pid}))
                    tokens = json.loads(out.read_text())["total_output_tokens"]
                    server_s, other_s = cpu_delta(s0, s1), cpu_delta(b0, b1)
                    cpu_per_tok[mode].append((server_s + other_s) / tokens * 1e3)
                    if page is not None:
                        page.close()
                    print(f"rep {rep + 1} page {mode}: {results[mode][-1]:.1f} tok/s; CPU ms per output token: "
                          f"server {server_s / tokens * 1e3:.3f}, browser + client {other_s / tokens * 1e3:.3f}, "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
            browser.close()
        table(results, "closed", "open", "16 streams, CPU server: output tok/s")
        table(cpu_per_tok, "closed", "open", "CPU ms per output token (server + browser + bench client)")
    finally:
        server.terminate()
        server.wait(30)


def gpu(model: str, reps: int) -> None:
    results: dict[str, list[float]] = {"0": [], "1.0": []}
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    for rep in range(reps):
        for interval in (("0", "1.0") if rep % 2 == 0 else ("1.0", "0")):
            cmd = [sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", model, "--load-format", "dummy",
                   "--dataset", "w1", "--max-model-len", "4096", "--kv-snapshot-interval-s", interval,
                   "--output-json", str(out)]
            subprocess.run(cmd, check=True, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[interval].append(json.loads(out.read_text())["output_tokens_per_second"])
            print(f"rep {rep + 1} interval {interval}: {results[interval][-1]:.0f} tok/s", flush=True)
    table(results, "0", "1.0", f"W1 {model}, KV map never vs every 1 s: output tok/s")


def table(results: dict[str, list[float]], base: str, other: str, title: str) -> None:
    b, o = statistics.median(results[base]), statistics.median(results[other])
    print(f"\n| {title} | runs | median |\n|---|---|---|")
    for k in (base, other):
        print(f"| {k} | {' / '.join(f'{x:.1f}' for x in results[k])} | {statistics.median(results[k]):.1f} |")
    print(f"| ratio {other} / {base} | | {o / b:.4f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("where", choices=["cpu", "gpu"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model", default="qwen3-0.6b")
    a = ap.parse_args()
    cpu(a.reps) if a.where == "cpu" else gpu(a.model, a.reps)


if __name__ == "__main__":
    main()
