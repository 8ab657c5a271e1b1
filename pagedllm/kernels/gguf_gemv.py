"""y = x @ W^T for GGUF block weights on the GPU: a GEMV for decode batches, dequantize + cuBLAS above.

Layout: kernels/gguf_dequant.py (qs (K // 8, N) int32 natural-order nibbles, per-sub-block scales,
K-quant super-block d / dmin, all K-major with N contiguous).

    M <= MAX_M (4)    `_gguf_gemv_kernel`: the blocks streamed once. A step loads a (BLOCK_KP, BLOCK_N)
                      tile of words and its scales (`load_step`), then for each of the PF values j of
                      a word dequantizes the (BLOCK_KP, BLOCK_N) weights of rows k0 + kp * PF + j in
                      registers (`value_j`, no layout conversion) and meets them with those columns of
                      x, fp32 accumulation: M <= FMA_MAX_M (4) by FMA (acc (BLOCK_KP, BLOCK_N) +=
                      x[:, None] * w, one accumulator per row of x, summed over rows once at the
                      end); called directly with 5..64 rows (tests, tuning), by a tensor-core dot per
                      j (w rounded to x's dtype, as the cuBLAS path's scratch is; x rows padded to
                      16; K of a dot = BLOCK_KP >= 16).
                      Split-K as kernels/gemv.py:
                      the last of an N-block's SPLIT_K programs to arrive sums the fp32 partials in
                      split order (`store_split_k_output`), one launch, no memset, deterministic.
    M > MAX_M         `dequantize_packed` writes the (K, N) weight in x's dtype to a scratch (freed
                      after the call; column chunks of <= SCRATCH_BYTES) and cuBLAS multiplies
                      (BENCHMARKS.md, issue 19: 0.5-0.7x of bf16 cuBLAS at M = 256, ~0.9x at 2048).

Reference: `gguf_linear_ref` (dequantize to fp32, matmul in fp32); the CPU path of the GPU method.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_plan, store_split_k_output
from pagedllm.kernels.gguf_dequant import (
    QTYPE_ID,
    GGUFPacked,
    dequantize_packed,
    dequantize_packed_ref,
    kernel_args,
    load_step,
    pack_factor,
    q_j,
    value_j,
)

__all__ = ["FMA_MAX_M", "KERNEL_MAX_M", "MAX_M", "GGUFGemvConfig", "gguf_gemv", "gguf_gemv_config", "gguf_linear",
           "gguf_linear_ref"]

KERNEL_MAX_M = 64  # rows the GEMV kernel takes (tensor cores from FMA_MAX_M + 1)
# Up to this many rows the GEMV multiplies on CUDA cores (FMA): one dequantized weight serves every
# row. H200, Llama-3.1-8B shapes (scripts/gpu_gguf_check.py, 2026-12-01): the tensor-core path at
# M = 16 took 2.4-3.6x the FMA path's M = 1 time (14336 x 4096 Q4_K: 83.0 vs 32.6 us), and at M <= 16
# it costs the same for any M (x padded to 16 rows), while FMA adds one FFMA per weight and row.
FMA_MAX_M = 4
# Rows `gguf_linear` sends to the GEMV; more take dequantize + cuBLAS, which the same run puts 5-20%
# ahead of the tensor-core GEMV at M = 16 (its scratch costs the M = 256 time minus cuBLAS's: 14336 x
# 4096 Q4_K ~44 us + cuBLAS 31 us at M = 16 = ~75 us vs 83.0; 4096 x 4096 Q4_K ~23 vs 24.6).
MAX_M = FMA_MAX_M
# Largest dequantized scratch for the cuBLAS path (bytes): Llama-3.1-8B's gate_up (28672 x 4096 bf16,
# 235 MB) takes two chunks, down / qkv / o one.
SCRATCH_BYTES = 128 << 20
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class GGUFGemvConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    BLOCK_KP: int  # word rows per step (BLOCK_K = BLOCK_KP * PF inputs, PF 8, Q8_0 4; divides 256)
    SPLIT_K: int  # programs per N-block (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int
    FACTORED: bool = False  # M == 1 only: scales applied to each word row's partial sums (see the kernel)
    # Next step's words and scales loaded before this step's math (loop-carried registers): Triton
    # software-pipelines none of this loop's loads (no cp.async in its sm_90 SASS), so each step
    # otherwise waits a DRAM round trip; costs registers (occupancy). On at M = 1 (`gguf_gemv_config`;
    # chosen from SASS, not yet timed on the GPU: BENCHMARKS.md, issue 19).
    PREFETCH: bool = False


@triton.jit
def _gguf_gemv_kernel(
    x_ptr, qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    QTYPE: tl.constexpr, HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
    FACTORED: tl.constexpr, PREFETCH: tl.constexpr,
):
    PF: tl.constexpr = 4 if QTYPE == 2 else 8
    BLOCK_K: tl.constexpr = BLOCK_KP * PF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    # FMA with 2..4 rows: one 2-D accumulator per row, all in the word tile's layout (a 3-D (M, KP, N)
    # accumulator costs shared-memory layout conversions in the loop and spills: seen in sm_90 SASS).
    acc1 = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    # x row r of the FMA rows (r < BLOCK_M <= 4) is read while k < k_lim_r: K for real rows, 0 past M
    k_lim1 = tl.where(M > 1, K, 0)
    k_lim2 = tl.where(M > 2, K, 0)
    k_lim3 = tl.where(M > 3, K, 0)
    if PREFETCH:  # the first step's tiles; in the loop, step i + 1's loads are issued before step i's math
        n_words, _, n_hq, n_s, n_o = load_step(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k_start, offs_n, mask_n,
                                               N, k_end, QTYPE, BLOCK_KP)
    for k0 in range(k_start, k_end, BLOCK_K):
        if PREFETCH:
            words, hq, s, o = n_words, n_hq, n_s, n_o
            hi = words >> 16
            n_words, _, n_hq, n_s, n_o = load_step(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k0 + BLOCK_K, offs_n,
                                                   mask_n, N, k_end, QTYPE, BLOCK_KP)
        else:
            words, hi, hq, s, o = load_step(qs_ptr, qh_ptr, s_ptr, m_ptr, d_ptr, dm_ptr, k0, offs_n, mask_n, N, K,
                                            QTYPE, BLOCK_KP)
        if FACTORED:
            # M == 1, scales out of the inner loop: a word row lies in one sub-block, so
            # sum_j x_j (q_j s + o) = s * sum_j x_j q_j + o * sum_j x_j (and (q - Z) s likewise).
            part = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
            xs = tl.zeros((BLOCK_KP,), dtype=tl.float32)
            for j in tl.static_range(PF):
                k = k0 + offs_kp * PF + j
                x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                part += x[:, None] * q_j(words, hi, hq, j, QTYPE, 0.0)
                xs += x
            if QTYPE == 0:
                acc += s * (part - 8.0 * xs[:, None])
            elif QTYPE == 2:
                acc += s * (part - 128.0 * xs[:, None])
            elif QTYPE == 4:
                acc += s * (part - 32.0 * xs[:, None])
            else:  # Q4_1, Q4_K: q s + o
                acc += s * part + o * xs[:, None]
        else:
            # Value j of every word: rows k = k0 + kp * PF + j of the weight, met by the same x columns.
            for j in tl.static_range(PF):
                w = value_j(words, hi, hq, s, o, j, QTYPE)
                k = k0 + offs_kp * PF + j
                if USE_DOT:
                    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :],
                                mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
                    acc += tl.dot(x, w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
                else:
                    x = tl.load(x_ptr + k, mask=k < K, other=0.0).to(tl.float32)
                    acc += x[:, None] * w
                    if BLOCK_M > 1:
                        x = tl.load(x_ptr + stride_xm + k, mask=k < k_lim1, other=0.0).to(tl.float32)
                        acc1 += x[:, None] * w
                    if BLOCK_M > 2:
                        x = tl.load(x_ptr + 2 * stride_xm + k, mask=k < k_lim2, other=0.0).to(tl.float32)
                        acc2 += x[:, None] * w
                        x = tl.load(x_ptr + 3 * stride_xm + k, mask=k < k_lim3, other=0.0).to(tl.float32)
                        acc3 += x[:, None] * w
    if USE_DOT:
        res = acc
    else:  # (BLOCK_M, BLOCK_N): row m of the result from accumulator m
        res = tl.where(offs_m[:, None] == 0, tl.sum(acc, 0)[None, :], 0.0)
        if BLOCK_M > 1:
            res = tl.where(offs_m[:, None] == 1, tl.sum(acc1, 0)[None, :], res)
        if BLOCK_M > 2:
            res = tl.where(offs_m[:, None] == 2, tl.sum(acc2, 0)[None, :], res)
            res = tl.where(offs_m[:, None] == 3, tl.sum(acc3, 0)[None, :], res)
    store_split_k_output(res, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid_n, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def gguf_gemv_config(m: int, p: GGUFPacked) -> GGUFGemvConfig:
    """Launch configuration. 16 word rows a step (128 inputs; Q8_0 64) and K split until the grid has
    >= 512 programs (M = 1) or >= 192, keeping >= 4 steps a split (kernels/wna16_gemv.py's H200 rule).
    Tiles chosen so that no type spills registers on sm_90 (compiled with ptxas on the CPU,
    2026-12-01): M = 1..4 (FMA) BLOCK_N 128, 8 warps, 3 stages (48-74 registers at M = 1); M = 5..16
    (tensor cores) BLOCK_N 64, 4 warps (64-79; BLOCK_N 128 spills at 4 warps for Q4_K / Q6_K, at 8
    for Q4_1); M = 17..64 BLOCK_N 64, 4 warps (96-128)."""
    if m <= FMA_MAX_M:
        block_n, block_kp, target, warps, stages = 128, 16, 512, 8, 3
    elif m <= 16:
        block_n, block_kp, target, warps, stages = 64, 16, 192, 4, 2
    else:  # 17..64 rows (not dispatched here by default)
        block_n, block_kp, target, warps, stages = 64, 16, 192, 4, 2
    n_blocks = triton.cdiv(p.n, block_n)
    steps = triton.cdiv(p.k, block_kp * pack_factor(p.qtype))
    split = 1
    while n_blocks * split < target and split * 8 <= steps:
        split *= 2
    # M = 1 prefetches the next step: in the sm_90 SASS the next step's loads then sit among this step's
    # math instead of stalling at the loop's top; registers Q4_0 48 -> 62, Q8_0 48 -> 58, Q4_1 / Q6_K
    # +1-3 (all <= 64: still 4 programs of 8 warps an SM), Q4_K 61 -> 99 (2 programs an SM)
    return GGUFGemvConfig(block_n, block_kp, split, warps, stages, PREFETCH=m == 1)


def gguf_gemv(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None,
              config: GGUFGemvConfig | None = None) -> torch.Tensor:
    """x (M <= 64, K) -> (M, N) in x's dtype, fp32 accumulation (every weight byte read once)."""
    m, k = x.shape
    if not 1 <= m <= KERNEL_MAX_M:
        raise ValueError(f"gguf_gemv takes 1..{KERNEL_MAX_M} rows, got {m}")
    if k != p.k:
        raise ValueError(f"x has {k} inputs, the GGUF weight {p.k}")
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or gguf_gemv_config(m, p)
    block_k = cfg.BLOCK_KP * pack_factor(p.qtype)
    if 256 % block_k or (m > FMA_MAX_M and cfg.BLOCK_KP < 16):
        raise ValueError(f"a step of {block_k} inputs must divide 256 (and have >= 16 word rows for "
                         f"M > {FMA_MAX_M}: tensor cores)")
    n_blocks = triton.cdiv(p.n, cfg.BLOCK_N)
    out = torch.empty((m, p.n), dtype=x.dtype, device=x.device)
    split, k_per_split, ws = split_k_plan(_workspaces, out, triton.cdiv(k, block_k), block_k, cfg.SPLIT_K, n_blocks,
                                          _WS_FLOATS, _WS_COUNTERS)
    use_dot = m > FMA_MAX_M
    _gguf_gemv_kernel[(n_blocks, split)](
        x, *kernel_args(p), bias if bias is not None else out, out, ws[0], ws[1],
        m, p.n, k, x.stride(0), out.stride(0), k_per_split, split,
        QTYPE=QTYPE_ID[p.qtype], HAS_BIAS=bias is not None, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no TF32 rounding
        USE_SPLIT=split > 1, BLOCK_M=max(16, triton.next_power_of_2(m)) if use_dot else triton.next_power_of_2(m), BLOCK_N=cfg.BLOCK_N, BLOCK_KP=cfg.BLOCK_KP,
        FACTORED=cfg.FACTORED and m == 1, PREFETCH=cfg.PREFETCH, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def gguf_linear(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None,
                dequant_min_m: int = MAX_M + 1, scratch_bytes: int = SCRATCH_BYTES) -> torch.Tensor:
    """CUDA (or the interpreter) x (M, K) -> (M, N) in x's dtype; same contract as `gguf_linear_ref`.

    From `dequant_min_m` rows: the weight dequantized to a scratch in x's dtype and cuBLAS, in column
    chunks of at most `scratch_bytes` (a 128256-row LM head would otherwise take a 1 GB scratch)."""
    if x.shape[0] < dequant_min_m:
        return gguf_gemv(x, p, bias)
    chunk = max(128, scratch_bytes // (p.k * x.element_size()) // 128 * 128)
    if chunk >= p.n:
        out = torch.matmul(x, dequantize_packed(p, x.dtype))
    else:
        out = torch.empty((x.shape[0], p.n), dtype=x.dtype, device=x.device)
        for start in range(0, p.n, chunk):
            end = min(p.n, start + chunk)
            torch.matmul(x, dequantize_packed(p, x.dtype, (start, end)), out=out[:, start:end])
    return out if bias is None else out + bias


def gguf_linear_ref(x: torch.Tensor, p: GGUFPacked, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, computed in fp32 from `dequantize_packed_ref`."""
    out = x.float() @ dequantize_packed_ref(p)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
