"""Decode-shape linears on the GPU: cuBLAS (F.linear) against `skinny_linear`, plus a config sweep.

Usage (on the H200, ~1 minute): python3 scripts/gemv_bench.py [--m 1 2 4 8] [--no-sweep] [--budget-s 80]

For each weight shape (N, K) and batch M it prints: time per call of cuBLAS and of skinny_linear
with `gemv_config`'s choice, the weight bandwidth each reaches, max |error| of each against an
fp32 reference, and which one `use_skinny_linear` would dispatch. Then, per (shape, M), the best
config of a small sweep (tiles, warps, stages, split-K, FMA/DOT), for updating `gemv_config`.

Timing is what a decode step sees: ITERS calls captured in one CUDA graph (no launch overhead, but
the kernel-to-kernel gaps are counted), replayed REPS times between CUDA events. Successive calls
cycle through enough copies of the weight (>= 256 MB in all) that none is served from the 50 MB L2,
as in a real step where every layer's weights are read once.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm.kernels.gemv import (  # noqa: E402
    GemvConfig,
    gemv_config,
    skinny_linear,
    skinny_linear_ref,
    use_skinny_linear,
)

# (N, K): Qwen3-0.6B qkv, o, gate_up, down, lm_head; Llama-3.1-8B qkv, o, gate_up, down, lm_head.
SHAPES = [
    (4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024),
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096),
]
ROTATE_BYTES = 256 << 20
REPS = 5


def sweep_configs(m: int, n: int) -> list[GemvConfig]:
    """A small grid around the defaults: the same list for every shape of one M (so compiled
    kernels are reused across shapes), plus split-K variants for narrow N."""
    block_m = 1 << (m - 1).bit_length()
    out = []
    for warps in (4, 8):
        for bn in (1, 2, 4, 8, 16):
            if block_m * bn <= 32 and (warps == 4 or bn in (2, 8)):
                out.append(GemvConfig(bn, 256 * warps, 1, warps, 1, False))
    for bn, bk, stages in ((16, 256, 3), (16, 128, 4), (32, 128, 4), (16, 256, 4)):
        out.append(GemvConfig(bn, bk, 1, 4, stages, True))
    if n <= 2048:
        out += [GemvConfig(16, 256, s, 4, 3, True) for s in (4, 8)]
        out += [GemvConfig(4, 1024, s, 4, 1, False) for s in (2, 4) if block_m * 4 <= 32]
    return out


def time_us(fn, copies: int) -> float:
    """Microseconds per fn(i) call, i cycling over the weight copies, measured inside a CUDA graph."""
    iters = max(copies, 16)
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / (REPS * iters)


def _cycling(op, x: torch.Tensor, weights: list[torch.Tensor], **kwargs):
    """fn(i) = op(x, weights[i % copies], **kwargs): call i reads a weight not in L2."""
    return lambda i: op(x, weights[i % len(weights)], **kwargs)


def bench_shape(n: int, k: int, ms: list[int], sweep: bool, deadline: float) -> tuple[list[str], int]:
    """Print one table row per M; return the best-config lines of the sweep and the mismatch count."""
    dtype = torch.bfloat16
    wbytes = n * k * 2
    copies = max(1, min(64, -(-ROTATE_BYTES // wbytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k**0.5 for _ in range(copies)]
    best_lines: list[str] = []
    bad = 0
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ref = skinny_linear_ref(x.float(), weights[0].float())
        err_cublas = (F.linear(x, weights[0]).float() - ref).abs().max().item()
        first = skinny_linear(x, weights[0])
        err_ours = (first.float() - ref).abs().max().item()
        t_cublas = time_us(_cycling(F.linear, x, weights), copies)
        t_ours = time_us(_cycling(skinny_linear, x, weights), copies)
        # Counters reset and partials summed in order: a call after ~100 graph calls is bit-equal.
        if not torch.equal(skinny_linear(x, weights[0]), first) or err_ours > 0.05:
            bad += 1
            print(f"  !! mismatch: err {err_ours:.3g} or not deterministic after the graph replays")
        cfg = gemv_config(m, n, k)
        pick = "ours" if use_skinny_linear(m, n, k, dtype) else "cuBLAS"
        print(f"{n:>7} {k:>6} {m:>2} | {t_cublas:>9.2f} {wbytes / t_cublas / 1e3:>6.0f} {err_cublas:>7.3f} | "
              f"{t_ours:>8.2f} {wbytes / t_ours / 1e3:>6.0f} {err_ours:>7.3f} | {t_cublas / t_ours:>6.2f}x "
              f"{pick:>6} | {tuple(cfg)}", flush=True)
        if not sweep or time.perf_counter() > deadline:
            continue
        results = []
        for c in sweep_configs(m, n):
            try:
                err = (skinny_linear(x, weights[0], config=c).float() - ref).abs().max().item()
                t = time_us(_cycling(skinny_linear, x, weights, config=c), copies)
            except Exception as e:  # a config the compiler rejects (e.g. out of shared memory)
                print(f"    {tuple(c)}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                continue
            if err > 0.05:
                print(f"    !! {tuple(c)}: max error {err:.3g}")
            results.append((t if err <= 0.05 else float("inf"), c, err))
        results.sort(key=lambda r: r[0])
        if results:
            t, c, err = results[0]
            best_lines.append(
                f"{n:>7} {k:>6} {m:>2}: best {tuple(c)} {t:.2f} us ({wbytes / t / 1e3:.0f} GB/s, err {err:.3f}); "
                f"default {t_ours:.2f} us; cuBLAS {t_cublas:.2f} us; next: "
                + ", ".join(f"{tuple(r[1])} {r[0]:.2f}" for r in results[1:3])
            )
    return best_lines, bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--no-sweep", action="store_true", help="only cuBLAS vs the default config")
    parser.add_argument("--budget-s", type=float, default=80.0, help="stop sweeping after this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    t0 = time.perf_counter()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, bf16, times per call inside a CUDA graph")
    head = (f"{'N':>7} {'K':>6} {'M':>2} | {'cuBLAS us':>9} {'GB/s':>6} {'err':>7} | {'ours us':>8} "
            f"{'GB/s':>6} {'err':>7} | {'speedup':>7} {'picks':>6} | default config")
    print(head)
    print("-" * len(head))
    best_lines: list[str] = []
    bad = 0
    for n, k in SHAPES:
        lines, shape_bad = bench_shape(n, k, args.m, not args.no_sweep, t0 + args.budget_s)
        best_lines += lines
        bad += shape_bad
        torch.cuda.empty_cache()
    if best_lines:
        print("\nbest sweep config per shape (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, USE_DOT):")
        print("\n".join(best_lines))
    print(f"\ndone in {time.perf_counter() - t0:.0f} s; {bad} mismatches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
