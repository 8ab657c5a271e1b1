"""W1 on the Llama-3.1-8B shape with quantization="fp8" (online), one `pagedllm bench throughput` process per
run, back to back, inside a wall budget: each run is TAG[:ENV=V,ENV=V][:extra flags], e.g.

    python3 scripts/gpu_fp8_w1_ab.py --budget 95 fp8 kvfp8::--kv-cache-dtype=fp8 \
        main-kvfp8:PAGEDLLM_FP8_KV_DOTS=0,PAGEDLLM_FUSED_ACT_QUANT=0:--kv-cache-dtype=fp8

(flags with '=' so they stay one token; the switches name the path a run takes: PAGEDLLM_FP8_KV_DOTS=0 and
PAGEDLLM_FUSED_ACT_QUANT=0 together are main's fp8 path before branch h43). A run starts only if the time
left covers a run (`--run-s`); the table last: tok/s, elapsed, engine start, the floor and the fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

BASE = ["-m", "pagedllm", "bench", "throughput", "--model", "llama3-8b", "--load-format", "dummy",
        "--skip-tokenizer-init", "--dataset", "w1", "--max-model-len", "4096", "--quantization", "fp8",
        "--hbm-bandwidth", "4.2e12", "--peak-flops", "1.6e15"]


def parse_run(spec: str) -> tuple[str, dict[str, str], list[str]]:
    tag, _, rest = spec.partition(":")
    env_part, _, flags = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in env_part.split(",") if kv)
    return tag, env, [f for f in flags.split(" ") if f]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--budget", type=float, default=95.0)
    ap.add_argument("--run-s", type=float, default=30.0, help="seconds a run needs (start + W1)")
    args = ap.parse_args()
    t0 = time.monotonic()
    rows = []
    for spec in args.runs:
        tag, env, flags = parse_run(spec)
        left = args.budget - (time.monotonic() - t0)
        if left < args.run_s:
            rows.append(f"| {tag} | not run: {left:.0f} s left of the budget | | | |")
            continue
        out = os.path.join(tempfile.gettempdir(), f"w1_{tag}.json")
        cmd = [sys.executable, *BASE, *flags, "--output-json", out]
        t = time.monotonic()
        proc = None
        try:
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=max(5.0, left - 2))
            wall = time.monotonic() - t
            d = json.load(open(out))
            rows.append(f"| {tag} | {d['output_tokens_per_second']:.0f} | {d['elapsed_time']:.2f} s | "
                        f"ready {d['startup_seconds']:.1f} s, process {wall:.0f} s | "
                        f"{d['floor_output_tokens_per_second']:.0f} ({100 * d['fraction_of_floor']:.1f}%) |")
        except Exception as e:  # noqa: BLE001 - a failed or cut run is a row, the next one still runs
            tail = (proc.stdout + proc.stderr)[-600:] if proc is not None else ""
            rows.append(f"| {tag} | failed: {type(e).__name__} {str(e)[:80]} | | | |")
            print(tail, flush=True)
        print(f"[{time.monotonic() - t0:.0f} s] {rows[-1]}  env={env} flags={flags}", flush=True)
    print("\n| run (W1, Llama-3.1-8B shape, fp8 online) | output tok/s | elapsed | start | floor (fraction) |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
