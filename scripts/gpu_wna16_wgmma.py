"""Issue 19, int4 at W1's batch sizes on sm_90: the Gluon GEMM with weights dequantized in wgmma's register
layout (kernels/wna16_wgmma.py) against the dispatch before it (kernels/wna16_mma.py's table, the scratch)
and bf16 cuBLAS, then W1 A/B.

    python3 scripts/gpu_wna16_wgmma.py [--only compile check time w1] [--table OUT.json] [--budget S]

compile  worker processes compile every candidate configuration once
check    candidates and the measured table == the fp32 reference at each 8B shape (M 16, 64, 160, 256, 300,
         1024; bias, an N tail, act-order, fp16 x, K split); max |err| / max |ref| < 1e-2
time     microseconds per call, CUDA-graph replays rotating over >= 150 MB of weight copies: bf16 cuBLAS,
         the dispatch before (PAGEDLLM_WNA16_WGMMA=0's), every candidate; per-layer sums per M; the table
         of buckets where a candidate beat the dispatch before, written as JSON (PAGEDLLM_WNA16_WGMMA_TABLE)
w1       `pagedllm bench throughput` W1 of the 8B AWQ dummy model: PAGEDLLM_WNA16_WGMMA=0, the built-in
         table, then the written table where one exists (each in its own process, back to back)
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
from gpu_wna16_stream import SHAPES, G, w1_runs, weights  # noqa: E402 - the 8B's linears, dummy int4 weights, AWQ

from pagedllm.kernels import wna16_gemm  # noqa: E402
from pagedllm.kernels.wna16_gemm import wna16_linear, wna16_linear_ref  # noqa: E402
from pagedllm.kernels.wna16_wgmma import wna16_wgmma_linear  # noqa: E402
from pagedllm.kernels.wna16_wgmma_config import WGMMAConfig  # noqa: E402

T0 = time.monotonic()
REPS = 12
ap = argparse.ArgumentParser()
ap.add_argument("--only", nargs="+", default=["compile", "check", "time", "w1"])
ap.add_argument("--table", default="/tmp/wna16_wgmma_table.json")
ap.add_argument("--budget", type=float, default=560.0, help="seconds; the time section stops short of it")
ap.add_argument("--ms", default="16,32,64,96,128,160,192,224,256,320,384,512", help="row counts timed")
ap.add_argument("--w1-s", type=float, default=200.0, help="seconds kept for the w1 section")
ap.add_argument("--check-ms", default="16,64,160,256,300,1024", help="row counts checked")
ap.add_argument("--w1-timeout", type=float, default=150.0, help="seconds a W1 run may take")
ARGS = ap.parse_args()
MS = tuple(int(v) for v in ARGS.ms.split(","))
CHECK_MS = tuple(int(v) for v in ARGS.check_ms.split(","))
C = WGMMAConfig


def candidates(m: int) -> list[WGMMAConfig]:
    """BLOCK_M the power of two holding m (16..256) and half of it; 64 columns on 4 warps or 128 on 8 (256
    on 8 past 64 rows, with 128-input steps on 128-row tiles); K split 1, 2, 4 (8 for <= 64 rows); 3-4 stages;
    256-row tiles with 64-input steps."""
    top = min(256, max(16, 1 << (m - 1).bit_length()))
    out = []
    for bm in sorted({top, max(16, top // 2)}):
        for bn, warps in ((64, 4), (128, 8)):
            if bm == 256 and bn == 64:
                continue  # spills (sm_90 compile)
            if bm == 256:  # 128-input steps spill there (two A tiles live): 64-input steps only
                out += [C(bm, bn, split, warps, stages, 8) for split in (1, 2) for stages in (3, 4)]
                continue
            for split in ((1, 2, 4, 8) if m <= 64 else (1, 2, 4)):
                for stages in (3, 4):
                    out.append(C(bm, bn, split, warps, stages))
            if bm >= 128:
                out.append(C(bm, bn, 1, warps, 4, 8))
        if m > 64 and bm <= 128:  # 256 columns on 8 warps: x re-read from L2 by half as many programs
            out += [C(bm, 256, split, 8, stages, 8) for split in (1, 2) for stages in (3, 4)]
            if bm == 128:  # 128-input steps fit there (223-231 registers; at 64 rows they spill)
                out += [C(bm, 256, split, 8, stages) for split in (1, 2) for stages in (3, 4)]
    return out


def all_configs() -> list[WGMMAConfig]:
    seen = {}
    for m in MS:
        for c in candidates(m):
            seen[c._replace(SPLIT_K=2 if c.SPLIT_K > 1 else 1)] = True
    return list(seen)


def _warm(cfg: tuple) -> str:
    c = C(*cfg)
    try:
        (w, s, z), = weights(512, 2048)
        wna16_wgmma_linear(torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16), w, s, z, G, c)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the config is then skipped where it fails again
        return f"{tuple(c)} FAILED {type(e).__name__}: {str(e)[:300]}"
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
    cases = 0
    shapes = dict(SHAPES, tail=(1000, 4096))
    for shape, (n, k) in shapes.items():
        (w, s, z), = weights(n, k)
        for m in CHECK_MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wna16_linear_ref(x, w, s, z, 4, G)
            cfgs = [C(16, 64, 4, 4, 4), C(64, 64, 2, 4, 4), C(64, 64, 1, 4, 4), C(128, 128, 1, 8, 3),
                    C(256, 128, 2, 8, 3, 8), C(128, 64, 4, 4, 3), C(256, 128, 1, 8, 4, 8), C(128, 256, 2, 8, 3, 8)]
            for c in cfgs:
                e = rel_err(wna16_wgmma_linear(x, w, s, z, G, c), ref)
                worst, cases = max(worst, (e, f"{shape} M={m} {tuple(c)}")), cases + 1
                if not e < 1e-2:
                    print(f"check {shape} M={m} {tuple(c)}: {e:.1e} FAIL", flush=True)
            if m == 160:
                bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
                e = rel_err(wna16_wgmma_linear(x, w, s, z, G, C(128, 128, 2, 8, 3), bias=bias),
                        wna16_linear_ref(x, w, s, z, 4, G, bias=bias))
                perm = torch.randperm(k, device="cuda").to(torch.int32)
                e2 = rel_err(wna16_wgmma_linear(x, w, s, z, G, C(256, 128, 1, 8, 3, 8), perm=perm),
                         wna16_linear_ref(x, w, s, z, 4, G, perm=perm))
                xh = x.half()
                e3 = rel_err(wna16_wgmma_linear(xh, w, s.half(), z, G, C(256, 128, 2, 8, 3, 8)),
                         wna16_linear_ref(xh, w, s.half(), z, 4, G))
                worst = max(worst, (e, f"{shape} bias"), (e2, f"{shape} act-order"), (e3, f"{shape} fp16"))
                cases += 3
        print(f"check {shape}: worst so far {worst[0]:.1e} ({worst[1]})", flush=True)
        del w, s, z
    record(f"check: worst max |err| / max |ref| over {cases} cases", f"{worst[0]:.1e} ({worst[1]})"
           + (" OK" if worst[0] < 1e-2 else " FAIL"))


TIMES: dict[str, dict[int, dict[str, float]]] = {}
WRONG: list[str] = []
BEST: dict[str, dict[int, tuple[float, WGMMAConfig | None]]] = {}


def before(x, w, s, z):
    wna16_gemm.WGMMA_ENABLED = False
    try:
        return wna16_linear(x, w, s, z, 4, G)
    finally:
        wna16_gemm.WGMMA_ENABLED = True


def time_kernels() -> None:
    for shape, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + (k // G) * n * 3
        copies = max(2, min(8, math.ceil(150e6 / nbytes)))
        ws = weights(n, k, copies)
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, math.ceil(150e6 / (2 * n * k))))]
        for m in MS:
            if time.monotonic() - T0 > ARGS.budget - ARGS.w1_s:
                print(f"(budget: {shape} M={m} and later not timed)", flush=True)
                break
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = TIMES.setdefault(shape, {}).setdefault(m, {})
            row["bf16"] = rotating_graph_us(lambda i: F.linear(x, wb[i]), len(wb), REPS)
            row["before"] = rotating_graph_us(lambda i: before(x, *ws[i]), copies, REPS)
            best = (float("inf"), None)
            ref = wna16_linear_ref(x, *ws[0], 4, G)
            for c in candidates(m):
                try:
                    e = rel_err(wna16_wgmma_linear(x, *ws[0], G, c), ref)
                    if not e < 1e-2:  # a wrong answer is never a pick (and is reported)
                        print(f"time {shape} M={m} {tuple(c)}: error {e:.1e}, left out", flush=True)
                        WRONG.append(f"{shape} M={m} {tuple(c)}")
                        continue
                    us = rotating_graph_us(lambda i: wna16_wgmma_linear(x, *ws[i], G, c), copies, REPS)
                except Exception as e:  # noqa: BLE001
                    print(f"time {shape} M={m} {tuple(c)} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                best = min(best, (us, c))
            BEST.setdefault(shape, {})[m] = best
            print(f"{shape} M={m}: bf16 {row['bf16']:.1f} before {row['before']:.1f} wgmma best {best[0]:.1f} "
                  f"{tuple(best[1] or ())}", flush=True)
        ws = wb = None
    print("\n| shape | M | bf16 cuBLAS | before (mma table / scratch) | wgmma best (BM, BN, split, warps, stages, kw) | before / best |")
    print("|---|---|---|---|---|---|")
    for shape, rows in TIMES.items():
        for m, row in rows.items():
            if m in BEST.get(shape, {}) and BEST[shape][m][1] is not None:
                b, c = BEST[shape][m]
                print(f"| {shape} | {m} | {row['bf16']:.1f} | {row['before']:.1f} | {b:.1f} {tuple(c)} | "
                      f"{row['before'] / b:.2f}x |")
    for m in MS:
        if all(m in BEST.get(s, {}) for s in SHAPES):
            tb = sum(TIMES[s][m]["bf16"] for s in SHAPES)
            to = sum(TIMES[s][m]["before"] for s in SHAPES)
            tn = sum(min(BEST[s][m][0], TIMES[s][m]["before"]) for s in SHAPES)
            record(f"a layer (8B), M={m}: bf16 / before / with wgmma where faster", f"{tb:.1f} / {to:.1f} / {tn:.1f} us")
    # buckets: max rows = each timed M (a call takes the first bucket >= its rows); the kernel where it won
    table = {}
    for shape, bests in BEST.items():
        n, k = SHAPES[shape]
        table[f"{n},{k}"] = [[m, None if c is None or TIMES[shape][m]["before"] <= us else list(c)]
                             for m, (us, c) in sorted(bests.items())]
    with open(ARGS.table, "w") as f:
        json.dump(table, f)
    record("time: candidates left out for a wrong answer", f"{len(WRONG)} {WRONG[:6]}")
    print("wna16_wgmma_config.TABLE entries:\n" + table_literal(table), flush=True)


def table_literal(table: dict) -> str:
    """The measured table as wna16_wgmma_config.TABLE's Python entries: runs of one pick merged into one bucket,
    trailing None buckets dropped (past the last bucket the Triton kernels run anyway), BLOCK_KW 16 left out."""
    names = {f"{n},{k}": name for name, (n, k) in SHAPES.items()}
    lines = []
    for key, buckets in table.items():
        merged: list[list] = []
        for mx, c in buckets:
            if merged and merged[-1][1] == c:
                merged[-1][0] = mx
            else:
                merged.append([mx, c])
        while merged and merged[-1][1] is None:
            merged.pop()
        cells = [f"({mx}, None)" if c is None else f"({mx}, _W({', '.join(map(str, c[:5] if c[5] == 16 else c))}))"
                 for mx, c in merged]
        lines.append(f"    ({key.replace(',', ', ')}): ({', '.join(cells)},),  # Llama-3.1-8B {names.get(key, key)}")
    return "\n".join(lines)


def w1() -> None:
    runs = {"before (PAGEDLLM_WNA16_WGMMA=0)": {"PAGEDLLM_WNA16_WGMMA": "0"},
            "wna16_wgmma_config.TABLE (built in)": {}}
    if os.path.exists(ARGS.table):
        runs["wgmma measured table"] = {"PAGEDLLM_WNA16_WGMMA_TABLE": ARGS.table}
    w1_runs(runs, lambda: ARGS.budget - (time.monotonic() - T0), ARGS.w1_timeout)


if __name__ == "__main__":
    sections = {"compile": precompile, "check": check, "time": time_kernels, "w1": w1}
    run_sections(sections, only=[s for s in ARGS.only if s in sections])
