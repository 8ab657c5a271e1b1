"""y = x @ W^T for GGUF block weights on the GPU: a GEMV for decode batches, dequantize + cuBLAS above.

Layout: kernels/gguf_dequant.py (qs (K // 8, N) int32 natural-order nibbles, per-sub-block scales,
K-quant super-block d / dmin, all K-major with N contiguous).

    M <= MAX_M (16)   `_gguf_gemv_kernel`: the blocks streamed once, each (BLOCK_K, BLOCK_N) tile
                      dequantized in registers (`dequant_tile`) and multiplied with fp32 accumulation:
                      M == 1 by FMA (acc (BLOCK_K, BLOCK_N) += x[:, None] * w, summed over K once at
                      the end), M = 2..16 by one tensor-core dot per tile (w rounded to x's dtype, as
                      the cuBLAS path's scratch is; x rows padded to 16). Split-K as kernels/gemv.py:
                      the last of an N-block's SPLIT_K programs to arrive sums the fp32 partials in
                      split order (`store_split_k_output`), one launch, no memset, deterministic.
    M > MAX_M         `dequantize_packed` writes the (K, N) weight in x's dtype to a scratch (freed
                      after the call) and cuBLAS multiplies: at prefill sizes the GEMM's cost dwarfs
                      the dequantization (BENCHMARKS.md, issue 19).

Reference: `gguf_linear_ref` (dequantize to fp32, matmul in fp32); the CPU path of the GPU method.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_workspace, store_split_k_output
from pagedllm.kernels.gguf_dequant import (
    QTYPE_ID,
    GGUFPacked,
    block_k_for,
    dequant_tile,
    dequantize_packed,
    dequantize_packed_ref,
    kernel_args,
)

__all__ = ["MAX_M", "GGUFGemvConfig", "gguf_gemv", "gguf_gemv_config", "gguf_linear", "gguf_linear_ref"]

MAX_M = 16
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class GGUFGemvConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    BLOCK_K: int  # inputs per step (divides 256 and K; a multiple of the sub-block)
    SPLIT_K: int  # programs per N-block (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w = dequant_tile(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, QTYPE, BLOCK_K,
                         BLOCK_N)
        if USE_DOT:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=mask_m[:, None],
                        other=0.0)
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
        else:
            x = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
            acc += x[:, None] * w
    if USE_DOT:
        res = acc
    else:
        res = tl.sum(acc, 0)[None, :]  # (1, BLOCK_N); BLOCK_M is 1
    store_split_k_output(res, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid_n, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def gguf_gemv_config(m: int, p: GGUFPacked) -> GGUFGemvConfig:
    """Launch configuration: K split until the grid has >= 512 programs (M = 1) or >= 192 (M > 1),
    keeping >= 4 steps a split (kernels/wna16_gemv.py's rule, which its H200 sweep chose)."""
    if m == 1:
        block_n, block_k, target, warps, stages = 64, 128, 512, 4, 3
    else:
        block_n, block_k, target, warps, stages = 64, 64, 192, 4, 2
    block_k = block_k_for(p, block_k)
    n_blocks = triton.cdiv(p.n, block_n)
    steps = p.k // block_k
    split = 1
    while n_blocks * split < target and split * 8 <= steps:
        split *= 2
    return GGUFGemvConfig(block_n, block_k, split, warps, stages)


def gguf_gemv(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None,
              config: GGUFGemvConfig | None = None) -> torch.Tensor:
    """x (M <= 16, K) -> (M, N) in x's dtype, fp32 accumulation."""
    m, k = x.shape
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gguf_gemv takes 1..{MAX_M} rows, got {m}")
    if k != p.k:
        raise ValueError(f"x has {k} inputs, the GGUF weight {p.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or gguf_gemv_config(m, p)
    if 256 % cfg.BLOCK_K or k % cfg.BLOCK_K or cfg.BLOCK_K % (16 if p.qtype == "Q6_K" else 32):
        raise ValueError(f"BLOCK_K {cfg.BLOCK_K} must divide 256 and K {k} and hold whole sub-blocks")
    steps = k // cfg.BLOCK_K
    k_per_split = triton.cdiv(steps, max(1, cfg.SPLIT_K)) * cfg.BLOCK_K
    split = triton.cdiv(k, k_per_split)
    n_blocks = triton.cdiv(p.n, cfg.BLOCK_N)
    out = torch.empty((m, p.n), dtype=x.dtype, device=x.device)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else None
    if ws is None or split * m * p.n > _WS_FLOATS or n_blocks > _WS_COUNTERS:
        split, k_per_split = 1, k
        ws = (out, out)  # never read: the split-K branch is compiled out
    use_dot = m > 1
    _gguf_gemv_kernel[(n_blocks, split)](
        x, *kernel_args(p), bias if bias is not None else out, out, ws[0], ws[1],
        m, p.n, k, x.stride(0), out.stride(0), k_per_split, split,
        QTYPE=QTYPE_ID[p.qtype], HAS_BIAS=bias is not None, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no TF32 rounding
        USE_SPLIT=split > 1, BLOCK_M=16 if use_dot else 1, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def gguf_linear(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None,
                dequant_min_m: int = MAX_M + 1) -> torch.Tensor:
    """CUDA (or the interpreter) x (M, K) -> (M, N) in x's dtype; same contract as `gguf_linear_ref`."""
    if x.shape[0] < dequant_min_m:
        return gguf_gemv(x, p, bias)
    w = dequantize_packed(p, x.dtype)
    out = torch.matmul(x, w)
    return out if bias is None else out + bias


def gguf_linear_ref(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, computed in fp32 from `dequantize_packed_ref`."""
    out = x.float() @ dequantize_packed_ref(p)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
