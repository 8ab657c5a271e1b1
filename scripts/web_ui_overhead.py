"""What the web console costs: the CPU server's 16-stream throughput with the page open against
without, and (on a GPU) offline W1 with the engine mapping its KV pool as the console makes it do.

    python scripts/web_ui_overhead.py cpu [--reps 3]          # embedded SmolLM2 server, 16 streams
    python scripts/web_ui_overhead.py gpu --model qwen3-0.6b   # W1, kv snapshot every 1 s vs never

Runs alternate (without, with, with, without, ...) and the table shows every run and the medians.
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

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
MODEL = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                    results[mode].append(bench_serve(port, out))
                    if page is not None:
                        page.close()
                    print(f"rep {rep + 1} page {mode}: {results[mode][-1]:.1f} tok/s", flush=True)
            browser.close()
        table(results, "closed", "open", "16 streams, CPU server: output tok/s")
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
