"""Issue 19, batch-1 int4: the mma.sync one-row kernel (kernels/wna16_mma8.py) against the one-row
dispatch, at Llama-3.1-8B's shapes, then the 8B AWQ decode step with its winners, in one call.

    python3 scripts/gpu_wna16_mma8.py [--only compile check time step] [--budget S] [--table T.json]

compile  worker processes compile every candidate at every shape (Triton's disk cache, the engine's dir)
check    every candidate against the fp32 reference at the four shapes (M = 1, bf16), and the kernel's
         GPU tests (tests/kernels/test_wna16_mma8.py: M 1 / 3 / 8, fp16, bias, act-order, a column tail)
time     CUDA-graph replays rotating over >= 100 MB of weight copies: us (GB/s of int4 words + scales +
         zeros) per shape and candidate at M = 1, the dispatch beside; M = 2, 4, 8 with the best of M = 1
step     batch-1 decode step of the 8B AWQ g128 dummy model (128 in / 257 out, 3 iterations): first the
         dispatch as committed in its own process (`bench latency`), then in this process with each
         shape's winner, where faster, routed to wna16_mma8 (the table `--table` writes)
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_wna16_stream as base  # noqa: E402 - sets the engine's Triton cache directory
from _gpu_common import record, rotating_graph_us, run_sections  # noqa: E402

from pagedllm.kernels import wna16_stream_config  # noqa: E402
from pagedllm.kernels.wna16_gemm import wna16_linear, wna16_linear_ref  # noqa: E402
from pagedllm.kernels.wna16_mma8 import MMA8Config, wna16_mma8_linear  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--only", nargs="+", default=["compile", "check", "time", "step"])
ap.add_argument("--budget", type=float, default=540.0)
ap.add_argument("--table", default=None, help="write the winners here as JSON")
ARGS = ap.parse_args()
T0 = time.monotonic()
G, SHAPES = base.G, base.SHAPES
PAIRS = [(64, 1), (64, 2), (64, 4), (128, 2), (128, 4), (128, 8), (256, 4), (256, 8)]  # (BLOCK_N, num_warps)
CANDS = {f"{'v' if c.VEC else 'm'}{c.BLOCK_N}x{c.STEPS}w{c.num_warps}": c for c in
         [MMA8Config(bn, steps, w, True) for bn, w in PAIRS for steps in (2, 4, 8)]
         + [MMA8Config(bn, steps, w, False) for bn, w in PAIRS for steps in (4, 8)]}
ERRS: dict[str, dict[str, float]] = {}
TIMES: dict[str, dict[str, float]] = {}
WIN: dict[str, str] = {}


def _warm(job: tuple[str, str]) -> str:
    shape, name = job
    n, k = SHAPES[shape]
    t0 = time.monotonic()
    try:
        (w, s, z), = base.weights(n, k)
        wna16_mma8_linear(torch.randn(1, k, device="cuda", dtype=torch.bfloat16), w, s, z, G, CANDS[name])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the candidate then fails its check
        return f"{shape}/{name} FAILED {type(e).__name__}: {str(e)[:300]}"
    return f"{time.monotonic() - t0:.1f}"


def precompile() -> None:
    jobs = [(shape, name) for shape in SHAPES for name in CANDS]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(15, os.cpu_count() or 4)) as pool:
        done = pool.map(_warm, jobs, chunksize=1)
    failed = [d for d in done if "FAILED" in d]
    record("compile", f"{len(jobs)} launches in {time.monotonic() - t0:.1f} s, {len(failed)} failed")
    for f in failed[:6]:
        print(f, flush=True)


def check() -> None:
    torch.manual_seed(0)
    for shape, (n, k) in SHAPES.items():
        (w, s, z), = base.weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wna16_linear_ref(x, w, s, z, 4, G).float()
        scale = ref.abs().max().item()
        errs = {}
        for name, cfg in CANDS.items():
            try:
                errs[name] = (wna16_mma8_linear(x, w, s, z, G, cfg).float() - ref).abs().max().item() / scale
            except Exception as e:  # noqa: BLE001 - one broken candidate must not hide the others
                errs[name] = float("inf")
                print(f"{shape}/{name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        errs["dispatch"] = (wna16_linear(x, w, s, z, 4, G).float() - ref).abs().max().item() / scale
        ERRS[shape] = errs
        worst = max(errs, key=errs.get)
        bad = sum(e >= 1e-2 for e in errs.values())
        record(f"check {shape} M=1, {len(errs)} launches", f"worst {errs[worst]:.1e} ({worst}), {bad} wrong")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_wna16_mma8.py"],
                          capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    record("tests/kernels/test_wna16_mma8.py on the GPU", tail[-1] if tail else f"rc {proc.returncode}")
    if proc.returncode:
        print("\n".join(tail[-40:]), flush=True)


def ok(shape: str, name: str) -> bool:
    return ERRS.get(shape, {}).get(name, 0.0) < 1e-2


def time_kernels() -> None:
    for shape, (n, k) in SHAPES.items():
        if time.monotonic() - T0 > ARGS.budget - 150:
            print(f"(budget: {shape} not timed)", flush=True)
            continue
        nbytes = n * k // 2 + (k // G) * n * 3
        copies = max(2, min(12, math.ceil(100e6 / nbytes)))
        ws = base.weights(n, k, copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row = TIMES.setdefault(shape, {})
        row["dispatch"] = rotating_graph_us(lambda i: wna16_linear(x, *ws[i], 4, G), copies, base.REPS)
        for name, cfg in CANDS.items():
            if not ok(shape, name):
                continue
            try:
                row[name] = rotating_graph_us(lambda i: wna16_mma8_linear(x, *ws[i], G, cfg), copies, base.REPS)
            except Exception as e:  # noqa: BLE001
                print(f"time {shape}/{name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        best = min((v, nm) for nm, v in row.items() if nm != "dispatch")
        WIN[shape] = best[1]
        record(f"time {shape} {n}x{k} M=1", f"best {best[1]} {best[0]:.1f} us ({nbytes / best[0] / 1e3:.0f} GB/s); "
               f"dispatch {row['dispatch']:.1f} us ({nbytes / row['dispatch'] / 1e3:.0f} GB/s)")
        for m in (2, 4, 8):
            xm = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            d = rotating_graph_us(lambda i: wna16_linear(xm, *ws[i], 4, G), copies, base.REPS)
            t = rotating_graph_us(lambda i: wna16_mma8_linear(xm, *ws[i], G, CANDS[best[1]]), copies, base.REPS)
            record(f"time {shape} M={m}", f"{best[1]} {t:.1f} us, dispatch {d:.1f} us")
        ws = None
    names = ["dispatch"] + list(CANDS)
    print("\n| us a call | " + " | ".join(TIMES) + " | per layer |")
    print("|---" * (len(TIMES) + 2) + "|")
    for name in names:
        if not all(name in TIMES[s] for s in TIMES):
            continue
        cells = [f"{TIMES[s][name]:.1f}" for s in TIMES]
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(TIMES[s][name] for s in TIMES):.1f} |")
    if TIMES:
        best_layer = sum(min(TIMES[s].values()) for s in TIMES)
        record("one-row int4 per layer: best per shape / dispatch",
               f"{best_layer:.1f} / {sum(TIMES[s]['dispatch'] for s in TIMES):.1f} us")


def step() -> None:
    if time.monotonic() - T0 > ARGS.budget - 110:
        print("(budget: no step)", flush=True)
        return
    cfg_dir = base.quant_model_dir("awq")
    proc = subprocess.run([sys.executable, "-m", "pagedllm", "bench", "latency", "--model", cfg_dir, "--load-format",
                           "dummy", "--skip-tokenizer-init", "--batch-size", "1", "--input-len", "128", "--output-len",
                           "257", "--max-model-len", "4096", "--num-iters", "3"],
                          capture_output=True, text=True, timeout=max(30, ARGS.budget - (time.monotonic() - T0) - 60))
    line = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "Decode step" in ln]
    record("batch-1 decode step, 8B AWQ, the dispatch as committed (bench latency)", line[-1] if line else
           f"failed rc {proc.returncode}: {(proc.stdout + proc.stderr)[-300:]}")
    table = {}
    for shape, name in WIN.items():
        if TIMES[shape][name] < TIMES[shape]["dispatch"]:
            table[SHAPES[shape]] = CANDS[name]
    if ARGS.table:
        json.dump({f"{n}x{k}": list(c) for (n, k), c in table.items()}, open(ARGS.table, "w"))
    if not table:
        record("batch-1 decode step with wna16_mma8", "no shape faster: not run")
        return
    wna16_stream_config._TABLE.update(table)
    llm, steps = base.batch1_steps("awq")
    record(f"batch-1 decode step, 8B AWQ, wna16_mma8 at {', '.join(f'{n}x{k}' for n, k in table)}",
           f"mean {statistics.fmean(steps) * 1e3:.3f} ms, p50 {statistics.median(steps) * 1e3:.3f} ms")


if __name__ == "__main__":
    sections = {"compile": precompile, "check": check, "time": time_kernels, "step": step}
    ok_all = run_sections(sections, ARGS.only)
    sys.exit(0 if ok_all else 1)
