"""Issue 19, int4 at W1's batch sizes on the H200: the one-dot-a-step GEMM (kernels/wna16_mma.py) against the
path before it (tensor-core GEMV <= 64 / 128 rows, then dequantize + cuBLAS) and bf16 cuBLAS, then W1 A/B.

    python3 scripts/gpu_wna16_mma.py [--only compile check time w1] [--shapes 8b|72b|both] [--table OUT.json]

compile  worker processes compile every candidate configuration once (their compiled forms depend on the
         constexprs only: every shape and row count here is a multiple of 16)
check    the rule's configuration and a few others == the fp32 reference at each shape (M 16, 64, 200, 256,
         1024; act-order at 64; fp16 x at 256); max |err| / max |ref| < 1e-2 (bf16 output rounding ~4e-3)
time     microseconds per call, CUDA-graph replays rotating over >= 150 MB of weight copies: bf16 cuBLAS, the
         path before (PAGEDLLM_WNA16_MMA=0's dispatch), dequantize + cuBLAS, the dispatch's choice
         (wna16_mma_config: its table or rule) and every candidate; a table per shape, per-layer sums per
         M, and the built-in table with this run's buckets put in, written as JSON
         (PAGEDLLM_WNA16_MMA_TABLE's format: per (N, K) and row bucket the fastest candidate, or null
         where the path before is faster)
w1       `pagedllm bench throughput` W1 of the 8B AWQ dummy model: PAGEDLLM_WNA16_MMA=0, the built-in
         table, the written table (each in its own process, back to back)
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_common import record, rel_err, rotating_graph_us, run_sections  # noqa: E402
from gpu_wna16_stream import SHAPES as SHAPES_8B  # noqa: E402 - Llama-3.1-8B's four linears
from gpu_wna16_stream import G, w1_runs, weights  # noqa: E402 - the same dummy int4 weights and AWQ config

from pagedllm.kernels import wna16_gemm  # noqa: E402
from pagedllm.kernels.wna16_gemm import dequantize_wna16_triton, wna16_linear, wna16_linear_ref  # noqa: E402
from pagedllm.kernels.wna16_mma import wna16_mma_linear  # noqa: E402
from pagedllm.kernels.wna16_mma_config import TABLE, MMAConfig, mma_choice  # noqa: E402

T0 = time.monotonic()  # (gpu_wna16_stream's import set the engine's Triton cache directory)
SHAPES_72B = {"qkv72": (10240, 8192), "o72": (8192, 8192), "gate_up72": (59136, 8192), "down72": (8192, 29568)}
REPS = 12
ap = argparse.ArgumentParser()
ap.add_argument("--only", nargs="+", default=["compile", "check", "time", "w1"])
ap.add_argument("--shapes", default="8b", choices=["8b", "72b", "both"])
ap.add_argument("--table", default="/tmp/wna16_mma_table.json")
ap.add_argument("--budget", type=float, default=540.0, help="seconds; the time section stops short of it")
ap.add_argument("--ms", default="16,32,64,96,128,192,256,512,1024,2048", help="row counts timed")
ap.add_argument("--splits", default="1,2,4,8")
ap.add_argument("--no-before", action="store_true", help="w1: skip the PAGEDLLM_WNA16_MMA=0 run")
ap.add_argument("--kws", default="16", help="word rows a step (BLOCK_KW) timed: 16 and / or 8")
ARGS = ap.parse_args()
MS = tuple(int(v) for v in ARGS.ms.split(","))
SPLITS = tuple(int(v) for v in ARGS.splits.split(","))
KWS = tuple(int(v) for v in ARGS.kws.split(","))
SHAPES = {**(SHAPES_8B if ARGS.shapes != "72b" else {}), **(SHAPES_72B if ARGS.shapes != "8b" else {})}


def candidates(m: int) -> list[MMAConfig]:
    """The configurations timed at m rows: BLOCK_M (wgmma's N) the power of two holding m and half of it
    (16 at least, 256 at most), 64 / 128 / 256 columns (wgmma's M), K split 1-8 ways, 2-3 stages; the
    tiles that spill registers (sm_90 compile: 128 x 256, 256 x 256) left out."""
    top = min(256, max(16, 1 << (m - 1).bit_length()))
    out = []
    for bm in sorted({top, max(16, top // 2)}):
        for bn in (64, 128, 256):
            if bm * bn > 128 * 128 and (bm, bn) != (256, 128):
                continue
            warps = 8 if bm * bn >= 128 * 128 or bn == 256 else 4
            for split in SPLITS:
                for kw in KWS:
                    for stages in ((2, 3) if kw == 16 else (3, 4)):
                        out.append(MMAConfig(bm, bn, split, warps, stages, kw))
    return out


def all_configs() -> list[MMAConfig]:
    seen = {}
    for m in MS:
        for c in candidates(m) + [c for n, k in SHAPES.values() if (c := mma_choice(m, n, k))]:
            seen[(c.BLOCK_M, c.BLOCK_N, c.SPLIT_K > 1, c.num_warps, c.num_stages, c.BLOCK_KW)] = c._replace(
                SPLIT_K=2 if c.SPLIT_K > 1 else 1)
    return list(seen.values())


def _warm(cfg: tuple) -> str:
    c = MMAConfig(*cfg)
    try:
        (w, s, z), = weights(512, 2048)
        wna16_mma_linear(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16), w, s, z, G, config=c)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the config is then skipped where it fails again
        return f"{tuple(c)} FAILED {type(e).__name__}: {str(e)[:160]}"
    return ""


def precompile() -> None:
    cfgs = [tuple(c) for c in all_configs()]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(15, os.cpu_count() or 4)) as pool:
        done = [d for d in pool.map(_warm, cfgs, chunksize=1) if d]
    record(f"compile: {len(cfgs)} configurations", f"{time.monotonic() - t0:.1f} s; failed: {done or 'none'}")


def check() -> None:
    torch.manual_seed(0)
    worst = (0.0, "")
    for shape, (n, k) in SHAPES.items():
        (w, s, z), = weights(n, k)
        for m in (16, 64, 200, 256, 1024):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wna16_linear_ref(x, w, s, z, 4, G)
            cfgs = {"64x128 s2": MMAConfig(64, 128, 2, 4, 3), "128x128": MMAConfig(128, 128, 1, 8, 2),
                    "256x128 s2": MMAConfig(256, 128, 2, 8, 3), "16x64 s4": MMAConfig(16, 64, 4, 4, 3)}
            if mma_choice(m, n, k):
                cfgs["choice"] = mma_choice(m, n, k)
            for name, c in cfgs.items():
                e = rel_err(wna16_mma_linear(x, w, s, z, G, config=c), ref)
                worst = max(worst, (e, f"{shape} M={m} {name}"))
            e = rel_err(wna16_linear(x, w, s, z, 4, G), ref)
            worst = max(worst, (e, f"{shape} M={m} dispatch"))
            if m == 64:
                perm = torch.randperm(k, device="cuda").to(torch.int32)
                e = rel_err(wna16_mma_linear(x, w, s, z, G, perm=perm), wna16_linear_ref(x, w, s, z, 4, G, perm=perm))
                worst = max(worst, (e, f"{shape} M=64 act-order"))
            if m == 256:
                xh = x.half()
                e = rel_err(wna16_mma_linear(xh, w, s.half(), z, G), wna16_linear_ref(xh, w, s.half(), z, 4, G))
                worst = max(worst, (e, f"{shape} M=256 fp16"))
        print(f"check {shape}: worst so far {worst[0]:.1e} ({worst[1]})", flush=True)
        del w, s, z
    record("check: worst max |err| / max |ref| over shapes, rows, configs", f"{worst[0]:.1e} ({worst[1]})"
           + (" OK" if worst[0] < 1e-2 else " FAIL"))


TIMES: dict[str, dict[int, dict[str, float]]] = {}
BEST: dict[str, dict[int, tuple[float, MMAConfig]]] = {}


def old_path(x, w, s, z):
    wna16_gemm.MMA_ENABLED = False
    try:
        return wna16_linear(x, w, s, z, 4, G)
    finally:
        wna16_gemm.MMA_ENABLED = True


def time_kernels() -> None:
    for shape, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + (k // G) * n * 3
        copies = max(2, min(8, math.ceil(150e6 / nbytes)))
        ws = weights(n, k, copies)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(150e6 / (2 * n * k))))]
        for m in MS:
            if time.monotonic() - T0 > ARGS.budget - 200:  # room for w1
                print(f"(budget: {shape} M={m} and later not timed)", flush=True)
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = TIMES.setdefault(shape, {}).setdefault(m, {})
            row["bf16"] = rotating_graph_us(lambda i: F.linear(x, wb[i]), len(wb), REPS)
            row["old"] = rotating_graph_us(lambda i: old_path(x, *ws[i]), copies, REPS)
            row["scratch"] = rotating_graph_us(
                lambda i: x @ dequantize_wna16_triton(*ws[i], 4, G, x.dtype), copies, REPS)
            choice = mma_choice(m, n, k)
            row["choice"] = row["old"] if choice is None else rotating_graph_us(
                lambda i: wna16_mma_linear(x, *ws[i], G, config=choice), copies, REPS)
            best = (float("inf"), None)
            for c in candidates(m):
                try:
                    us = rotating_graph_us(lambda i: wna16_mma_linear(x, *ws[i], G, config=c), copies, REPS)
                except Exception as e:  # noqa: BLE001
                    print(f"time {shape} M={m} {tuple(c)} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                best = min(best, (us, c))
            BEST.setdefault(shape, {})[m] = best
            print(f"{shape} M={m}: bf16 {row['bf16']:.1f} old {row['old']:.1f} scratch {row['scratch']:.1f} "
                  f"choice {row['choice']:.1f} best {best[0]:.1f} {tuple(best[1] or ())}", flush=True)
        ws = wb = None
    print("\n| shape | M | bf16 cuBLAS | before (tc / scratch) | dequant + cuBLAS | the dispatch's choice | mma best (BM, BN, split, warps, stages) | before / best |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, rows in TIMES.items():
        for m, row in rows.items():
            if m not in BEST.get(shape, {}):
                continue
            b, c = BEST[shape][m]
            print(f"| {shape} | {m} | {row['bf16']:.1f} | {row['old']:.1f} | {row['scratch']:.1f} | {row['choice']:.1f} | "
                  f"{b:.1f} ({c.BLOCK_M}, {c.BLOCK_N}, {c.SPLIT_K}, {c.num_warps}, {c.num_stages}, kw {c.BLOCK_KW}) | "
                  f"{row['old'] / b:.2f}x |")
    for group in (SHAPES_8B, SHAPES_72B):
        names = [s for s in group if s in BEST]
        if len(names) < len(group):
            continue
        for m in MS:
            if all(m in BEST[s] for s in names):
                tb = sum(TIMES[s][m]["bf16"] for s in names)
                to = sum(TIMES[s][m]["old"] for s in names)
                tc = sum(TIMES[s][m]["choice"] for s in names)
                tn = sum(min(BEST[s][m][0], TIMES[s][m]["old"]) for s in names)
                record(f"a layer ({'8B' if group is SHAPES_8B else '72B'}), M={m}: bf16 / before / the choice / best",
                       f"{tb:.1f} / {to:.1f} / {tc:.1f} / {tn:.1f} us")
    # the built-in table with this run's buckets put in (a bucket measured here replaces the one of the
    # same max rows; the others stay), in PAGEDLLM_WNA16_MMA_TABLE's format
    table = {f"{n},{k}": {mx: (None if c is None else list(c[:5]) + ([c.BLOCK_KW] if c.BLOCK_KW != 16 else []))
                          for mx, c in b} for (n, k), b in TABLE.items()}
    for shape, bests in BEST.items():
        n, k = SHAPES[shape]
        row = table.setdefault(f"{n},{k}", {})
        for m in sorted(bests):
            us, c = bests[m]
            row[m] = None if c is None or TIMES[shape][m]["old"] <= us else list(c[:5]) + ([c.BLOCK_KW] if c.BLOCK_KW != 16 else [])
    table = {key: sorted(row.items()) for key, row in table.items()}
    with open(ARGS.table, "w") as f:
        json.dump(table, f)
    print(f"measured table -> {ARGS.table}: {json.dumps(table)}", flush=True)


def w1() -> None:
    runs = {"the built-in table": {}} if ARGS.no_before else {
        "before (PAGEDLLM_WNA16_MMA=0)": {"PAGEDLLM_WNA16_MMA": "0"}, "the built-in table": {}}
    if os.path.exists(ARGS.table):
        runs["mma measured table"] = {"PAGEDLLM_WNA16_MMA_TABLE": ARGS.table}
    w1_runs(runs, lambda: ARGS.budget - (time.monotonic() - T0), 200)


if __name__ == "__main__":
    sections = {"compile": precompile, "check": check, "time": time_kernels, "w1": w1}
    run_sections(sections, only=[s for s in ARGS.only if s in sections])
