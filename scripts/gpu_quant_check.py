"""Quantized GEMM kernels on the GPU at Llama-3.1-8B sizes: each against its torch reference, and
its time beside bf16 F.linear (cuBLAS). Run by scripts/gpu_quant_bench.sh (section `check`).

    python3 scripts/gpu_quant_check.py [--m 1 8 64 256 2048]

Prints one row per (linear, M, kernel): max |err| relative to max |ref|, microseconds, and the weight
bytes streamed per microsecond (GB/s) - for batch-1 decode the number that matters.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pagedllm.kernels.fp8_block_gemm import _expand_scales, fp8_block_linear, fp8_block_linear_ref
from pagedllm.kernels.scaled_mm import (
    FP8_DTYPE,
    choose_path,
    quantize_activation,
    scaled_gemm_triton,
    scaled_mm_ref,
    w8a8_linear,
)
from pagedllm.kernels.w8a16_gemv import w8a16_linear_ref
from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear, wna16_linear_ref

# (name, N, K) of one Llama-3.1-8B decoder layer's linears.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]


def bench(fn, *args, iters: int = 20) -> float:
    """Median microseconds of fn(*args) on the current stream."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def _w8a8_ref(x: torch.Tensor, xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The reference of the path `w8a8_linear` takes: weight-only ("w8a16": activations not quantized)
    or W8A8."""
    if choose_path(x.shape[0], wq.shape[0], wq.shape[1], wq.dtype) == "w8a16":
        return w8a16_linear_ref(x, wq, ws)
    return scaled_mm_ref(xq, wq, xs, ws, None, torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    args = parser.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        # int4, group 128 (AWQ / GPTQ after repacking)
        g = 128
        q = torch.randint(0, 16, (k, n), device=dev)
        scales = (torch.rand(k // g, n, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (k // g, n), device=dev, dtype=torch.uint8)
        qweight = pack_along_k(q, 4)
        # fp8 / int8 per channel
        w8, s8 = quantize_activation(w, FP8_DTYPE)
        wi, si = quantize_activation(w, torch.int8)
        s8, si = s8.flatten(), si.flatten()
        # fp8 with 128 x 128 block scales (weight_block_size, Qwen3-FP8's): the weight's codes, one scale a block
        blk = (128, 128)
        wb_scale = (torch.rand(n // 128, k // 128, device=dev) * 2e-4 + 1e-4)
        wb = (w.float() / _expand_scales(wb_scale, n, k, blk)).clamp(-448, 448).to(FP8_DTYPE)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_bf16 = bench(F.linear, x, w)
            rows.append((name, m, "bf16 F.linear", 0.0, t_bf16, n * k * 2 / t_bf16 / 1e3))
            ref = wna16_linear_ref(x, qweight, scales, zeros, 4, g)
            out = wna16_linear(x, qweight, scales, zeros, 4, g)
            t = bench(wna16_linear, x, qweight, scales, zeros, 4, g)
            rows.append((name, m, "w4a16 triton", rel_err(out, ref), t, n * k / 2 / t / 1e3))
            xq, xs = quantize_activation(x, FP8_DTYPE)
            ref = _w8a8_ref(x, xq, w8, xs, s8)
            out = w8a8_linear(x, w8, s8, None, None)
            t = bench(w8a8_linear, x, w8, s8, None, None)
            rows.append((name, m, f"fp8 {choose_path(m, n, k, FP8_DTYPE)}", rel_err(out, ref), t, n * k / t / 1e3))
            if m <= 16:
                # held to the W8A8 reference: at these rows the dispatch's own path is weight-only (its ref above)
                out = scaled_gemm_triton(xq, w8, xs, s8, None, torch.bfloat16)
                t = bench(scaled_gemm_triton, xq, w8, xs, s8, None, torch.bfloat16)
                w8a8_ref = scaled_mm_ref(xq, w8, xs, s8, None, torch.bfloat16)
                rows.append((name, m, "fp8 triton (no quant)", rel_err(out, w8a8_ref), t, n * k / t / 1e3))
            ref = fp8_block_linear_ref(x, wb, wb_scale, blk)
            out = fp8_block_linear(x, wb, wb_scale, blk)
            t = bench(fp8_block_linear, x, wb, wb_scale, blk)
            rows.append((name, m, "fp8 block 128x128 triton", rel_err(out, ref), t, n * k / t / 1e3))
            xq, xs = quantize_activation(x, torch.int8)
            ref = _w8a8_ref(x, xq, wi, xs, si)
            out = w8a8_linear(x, wi, si, None, None)
            t = bench(w8a8_linear, x, wi, si, None, None)
            rows.append((name, m, f"int8 {choose_path(m, n, k, torch.int8)}", rel_err(out, ref), t, n * k / t / 1e3))
    print("| linear | M | kernel | max rel err vs ref | us | weight GB/s |")
    print("|---|---|---|---|---|---|")
    for name, m, kern, err, t, bw in rows:
        print(f"| {name} | {m} | {kern} | {err:.2e} | {t:.1f} | {bw:.0f} |")
    bad = [r for r in rows if r[3] > 2e-2]
    print(f"kernels within 2e-2 of their reference: {len(rows) - len(bad)}/{len(rows)}" +
          (f"; OFF: {[(r[0], r[1], r[2], round(r[3], 4)) for r in bad]}" if bad else ""))


if __name__ == "__main__":
    main()
