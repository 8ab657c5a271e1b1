"""Block-wise FP8 GEMM (128 x 128 weight blocks, 1 x 128 activation groups) at Llama-3.1-8B's linears on
the GPU: the Triton kernel's tiles swept, and cuBLASLt's own block-scaled GEMM (`torch._scaled_mm` with a
(M, K/128) activation grid and a (K/128, N/128) weight grid, CUDA >= 12.9 on sm_90) beside it, each held to
`fp8_block_gemm_ref`; bf16 F.linear and the per-channel fp8 `_scaled_mm` for scale.

    python3 scripts/gpu_fp8_block_sweep.py [--only compile sweep] [--ms 1,16,64,...] [--budget S]

Times: CUDA-graph replays of 20 calls rotating over weight copies (>= 100 MB, so L2 does not serve repeats).
The last table: per (linear, M) the default config, the sweep's best, cuBLASLt block-wise, bf16, fp8 per-channel.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_common import record, rel_err, rotating_graph_us, run_sections  # noqa: E402

from pagedllm.kernels.fp8_block_gemm import (  # noqa: E402
    FP8_DTYPE,
    Fp8BlockConfig,
    _expand_scales,
    fp8_block_gemm,
    fp8_block_gemm_config,
    fp8_block_gemm_cublas,
    fp8_block_gemm_ref,
    per_token_group_quant_fp8,
)

ap = argparse.ArgumentParser()
ap.add_argument("--only", nargs="+", default=["compile", "linear", "sweep"])
ap.add_argument("--ms", default="1,8,16,32,64,128,192,256,512,2048,8192")
ap.add_argument("--budget", type=float, default=400.0, help="seconds; the sweep stops short of it")
ap.add_argument("--tiles", choices=["all", "default"], default="all",
                help="default: time only each row count's built-in Triton config (beside cuBLASLt), no sweep")
ARGS = ap.parse_args()
MS = [int(m) for m in ARGS.ms.split(",")]
T0 = time.monotonic()
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLK = (128, 128)


def candidates(m: int) -> list[Fp8BlockConfig]:
    out = []
    for bm in (16, 32, 64, 128):
        if bm > max(16, 2 * m):  # tiles far taller than the batch only add masked rows
            continue
        for bn in (64, 128, 256):
            for warps in (4, 8):
                for stages in (3, 4):
                    if bm * bn > 128 * 128 and warps == 4:
                        continue
                    if bn == 256 and bm == 128 and stages > 3:  # past sm_90 shared memory
                        continue
                    out.append(Fp8BlockConfig(bm, bn, 8, warps, stages))
    return out


def _all() -> list[Fp8BlockConfig]:
    seen: dict = {}
    for m in MS:
        for c in candidates(m):
            seen[c] = True
    return list(seen)


def _warm(cfg: tuple) -> str:
    c = Fp8BlockConfig(*cfg)
    try:
        qa = torch.randn(64, 512, device="cuda").to(FP8_DTYPE)
        qw = torch.randn(512, 512, device="cuda").to(FP8_DTYPE)
        fp8_block_gemm(qa, torch.ones(64, 4, device="cuda"), qw, torch.ones(4, 4, device="cuda"), BLK,
                       torch.bfloat16, config=c)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the config is skipped where it fails again
        return f"{cfg} FAILED {type(e).__name__}: {str(e)[:200]}"
    return ""


def precompile() -> None:
    cfgs = [tuple(c) for c in _all()] if ARGS.tiles == "all" else [tuple(fp8_block_gemm_config(m, 4096)) for m in MS]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(15, os.cpu_count() or 4)) as pool:
        bad = [d for d in pool.map(_warm, cfgs, chunksize=1) if d]
    record(f"compile: {len(cfgs)} configurations", f"{time.monotonic() - t0:.1f} s; failed: {bad or 'none'}")


def _weights(n: int, k: int) -> tuple[list, list, int]:
    """Rotating copies (>= 100 MB in all) of a random block-quantized weight, and bf16 copies of it."""
    copies = max(1, -(-100_000_000 // (n * k)))
    ws = []
    for _ in range(copies):
        w = torch.randn(n, k, device="cuda") / k**0.5
        sw = torch.rand(n // 128, k // 128, device="cuda") * 2e-4 + 1e-4
        qw = (w / _expand_scales(sw, n, k, BLK)).clamp(-448, 448).to(FP8_DTYPE)
        ws.append((qw, sw))
    wb = [(q.float() * _expand_scales(s, n, k, BLK)).to(torch.bfloat16) for q, s in ws[:max(1, -(-copies // 2))]]
    return ws, wb, copies


def _measure(name: str, n: int, m: int, k: int, ws: list, wb: list, copies: int) -> dict:
    """One (linear, M) row: every candidate checked against the reference and timed, then cuBLASLt's."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    qa, s = per_token_group_quant_fp8(x, 128)
    qa_cm, s_cm = per_token_group_quant_fp8(x, 128, column_major_scales=True)
    assert s_cm.stride() == (1, m) or m == 1, s_cm.stride()
    assert torch.equal(qa_cm.view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s_cm, s), "column-major scales"
    ref = fp8_block_gemm_ref(qa, s, ws[0][0], ws[0][1], BLK, torch.float32)
    row: dict = {"name": name, "m": m}
    row["bf16"] = rotating_graph_us(lambda i: F.linear(x, wb[i % len(wb)]), len(wb))
    row["quant"] = rotating_graph_us(lambda i: per_token_group_quant_fp8(x, 128), 1)
    default = fp8_block_gemm_config(m, n)
    best: tuple = (float("inf"), None)
    for c in candidates(m) if ARGS.tiles == "all" else [default]:
        try:
            out = fp8_block_gemm(qa, s, ws[0][0], ws[0][1], BLK, torch.bfloat16, config=c)
            err = rel_err(out, ref)
            if err > 1e-2:
                print(f"{name} M={m} {tuple(c)} WRONG {err:.2e}", flush=True)
                continue
            us = rotating_graph_us(
                lambda i, c=c: fp8_block_gemm(qa, s, ws[i][0], ws[i][1], BLK, torch.bfloat16, config=c), copies)
        except Exception as e:  # noqa: BLE001
            print(f"{name} M={m} {tuple(c)} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        if c == default:
            row["default"] = us
        best = min(best, (us, c))
    row["best"] = best
    try:
        out = fp8_block_gemm_cublas(qa, s_cm, ws[0][0], ws[0][1], torch.bfloat16)
        row["cublas_err"] = rel_err(out, ref)
        row["cublas"] = rotating_graph_us(
            lambda i: fp8_block_gemm_cublas(qa, s_cm, ws[i][0], ws[i][1], torch.bfloat16), copies)
    except Exception as e:  # noqa: BLE001
        row["cublas_err"] = float("nan")
        print(f"{name} M={m} cuBLASLt block-wise FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    sx = s.amax(dim=1, keepdim=True)  # (M, 1): row-wise scales, for the time only
    swc = ws[0][1].amax(dim=1).repeat_interleave(128)[:, None].t().contiguous()  # (1, N)
    try:
        row["fp8_rowwise"] = rotating_graph_us(
            lambda i: torch._scaled_mm(qa, ws[i][0].t(), scale_a=sx, scale_b=swc, out_dtype=torch.bfloat16,
                                       use_fast_accum=True), copies)
    except Exception as e:  # noqa: BLE001
        print(f"{name} M={m} rowwise FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    print(f"{name} M={m}: bf16 {row['bf16']:.1f} quant {row['quant']:.1f} default {row.get('default', 0):.1f} "
          f"best {best[0]:.1f} {tuple(best[1] or ())} cublas-block {row.get('cublas', float('nan')):.1f} "
          f"(err {row['cublas_err']:.1e}) fp8-rowwise {row.get('fp8_rowwise', float('nan')):.1f}", flush=True)
    return row


def sweep() -> None:
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        ws, wb, copies = _weights(n, k)
        for m in MS:
            if time.monotonic() - T0 > ARGS.budget:
                record("sweep", f"stopped at {name} M={m} (budget)")
                break
            rows.append(_measure(name, n, m, k, ws, wb, copies))
        del ws, wb
        torch.cuda.empty_cache()
    print("\n| linear | M | bf16 F.linear | group quant | Triton default | Triton best (BM, BN, GM, warps, stages) |"
          " cuBLASLt 1x128 x 128x128 (err) | fp8 row-wise _scaled_mm |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, c = r["best"]
        print(f"| {r['name']} | {r['m']} | {r['bf16']:.1f} | {r['quant']:.1f} | {r.get('default', float('nan')):.1f} | "
              f"{b:.1f} {tuple(c or ())} | {r.get('cublas', float('nan')):.1f} ({r['cublas_err']:.1e}) | "
              f"{r.get('fp8_rowwise', float('nan')):.1f} |")


def linear() -> None:
    """`fp8_block_linear` on each path against `fp8_block_linear_ref` (ragged M, bias, fp16)."""
    from pagedllm.kernels import fp8_block_gemm as fbg

    torch.manual_seed(1)
    worst = {}
    default = fbg.CUBLAS_BLOCK
    for cublas in (False, True):
        fbg.CUBLAS_BLOCK = cublas
        for n, k in ((6144, 4096), (4096, 14336)):
            qw = (torch.randn(n, k, device="cuda") * 50).clamp(-448, 448).to(FP8_DTYPE)
            sw = torch.rand(n // 128, k // 128, device="cuda") * 1e-3 + 1e-4
            for m, dtype, bias in ((1, torch.bfloat16, False), (7, torch.float16, True), (300, torch.bfloat16, True),
                                   (4099, torch.bfloat16, False)):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                b = torch.randn(n, device="cuda", dtype=dtype) if bias else None
                on_cublas = fbg.cublas_block_ok(x, qw, BLK)
                assert on_cublas == (cublas and dtype == torch.bfloat16), (cublas, m, dtype)  # fp16: Triton
                err = rel_err(fbg.fp8_block_linear(x, qw, sw, BLK, b), fbg.fp8_block_linear_ref(x, qw, sw, BLK, b))
                key = "cuBLASLt" if on_cublas else "Triton"
                worst[key] = max(worst.get(key, 0.0), err)
    fbg.CUBLAS_BLOCK = default
    for key, err in worst.items():
        record(f"fp8_block_linear on {key} vs its reference (M 1/7/300/4099, bias; fp16 on Triton)", f"worst {err:.2e}")


if __name__ == "__main__":
    sections = {"compile": precompile, "linear": linear, "sweep": sweep}
    run_sections(sections, only=[s for s in ARGS.only if s in sections])
