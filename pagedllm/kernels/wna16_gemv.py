"""W4A16 / W8A16 for decode batches (M <= 16; the kernel takes 64): stream the packed weights once, dequantize in registers.

Layout: kernels/wna16_gemm.py (qweight (K // pf, N) int32, pf = 32 // bits values of consecutive k per
word; scales / zeros (K // G, N)). At M <= 16 the GEMM is weight streaming: Llama-3.1-8B's down
projection is 29 MB of int4 words, 6 us at the H200's 4.8 TB/s, so what decides the speed is how few
instructions turn a word into products.

Program (pn, pk) owns output columns [pn * BLOCK_N, +BLOCK_N) for all M rows and K range
[pk * K_PER_SPLIT, +K_PER_SPLIT), walked in BLOCK_K = BLOCK_KP * pf steps. One step loads a
(BLOCK_KP, BLOCK_N) tile of words once (rows coalesced along N), and one scale / zero row (BLOCK_K
divides G, so a step lies in one group). Values come out of the words without int -> float
conversions (kernels/wna16_unpack.py: one LOP3 gives 2^23 + q * 2^(b*s) as fp32), and zero point and
group scale meet the step's partial sums once, not every value:

    y[m, n] += s[g, n] * (sum_k x[m, k] * q[k, n] - z[g, n] * sum_k x[m, k])

(a per-value zero point costs a shared-memory layout conversion per value j: seen in the sm_90 SASS).

Two inner products: FMA (M == 1): per value j, acc (BLOCK_KP, BLOCK_N) fp32 += x_j[:, None] * w_j
(x_j pre-scaled by 2^-(b*s), exact), the sum over rows once at the end; DOT (M = 2..64, padded to 16
or more): the step's words unpacked into one (BLOCK_K, BLOCK_N) tile of q (exact in bf16/fp16) and
one tensor-core dot with the contiguous (BLOCK_M, BLOCK_K) x tile.

Split-K reduction: as kernels/gemv.py, the last of an N-block's SPLIT_K programs to arrive (a
self-resetting per-block counter) sums the fp32 partials in split order, adds the bias and writes y:
one launch, no memset, deterministic. CUDA graphs: no host sync; the workspace is made outside any
capture (a capture that would make it runs SPLIT_K = 1).

Reference: `wna16_gemm.wna16_linear_ref`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_plan, store_split_k_output
from pagedllm.kernels.wna16_unpack import unpack_scaled, unpack_tile

__all__ = ["WNA16GemvConfig", "wna16_gemv", "wna16_gemv_config"]

MAX_M = 16  # rows `wna16_linear` sends here (the kernel itself takes up to KERNEL_MAX_M)
KERNEL_MAX_M = 64
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class WNA16GemvConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    BLOCK_KP: int  # packed word rows per step (BLOCK_K = BLOCK_KP * 32 // bits inputs)
    SPLIT_K: int  # programs per N-block (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int


@triton.jit
def _wna16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, perm_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, K, stride_xm, stride_om, K_PER_SPLIT, SPLIT_K,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PERM: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = 16 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PF
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    if USE_DOT:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
    w_ptrs = qw_ptr + ((k_start // PF) + offs_kp)[:, None].to(tl.int64) * N + offs_n[None, :]
    for k0 in range(k_start, k_end, BLOCK_K):
        # K is a whole number of BLOCK_K steps (groups are), so only the N edge is masked.
        words = tl.load(w_ptrs, mask=mask_n[None, :], other=0, eviction_policy="evict_first")
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        # The zero point leaves the per-value work: sum_k x (q - z) = sum_k x q - z * sum_k x, so the
        # unpacked values need only the constant 2^23 off, and z / s meet the partial sums once a step.
        if USE_DOT:
            x_off = k0 + offs_k
            if HAS_PERM:  # act-order: weight row k holds input perm[k]; x itself is not reordered
                x_off = tl.load(perm_ptr + x_off)
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + x_off[None, :], mask=mask_m[:, None], other=0.0)
            q = unpack_tile(words, BITS, BLOCK_K, BLOCK_N)
            part = tl.dot(x, q.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += (part - xsum[:, None] * z[None, :]) * s[None, :]
        else:
            hi = words >> 16
            part = tl.zeros((BLOCK_KP, BLOCK_N), dtype=tl.float32)
            xsum1 = tl.zeros((BLOCK_KP,), dtype=tl.float32)
            for j in tl.static_range(PF):
                fac = 1 << (BITS * (j % HALF))  # constexpr int
                w = unpack_scaled(words, hi, j, BITS) - 8388608.0  # q * fac, exact
                x_off = k0 + offs_kp * PF + j
                if HAS_PERM:
                    x_off = tl.load(perm_ptr + x_off)
                xj = tl.load(x_ptr + x_off).to(tl.float32)
                xsum1 += xj
                part += (xj * (1.0 / fac))[:, None] * w
            acc += (part - z[None, :] * xsum1[:, None]) * s[None, :]
        w_ptrs += BLOCK_KP * N
    if USE_DOT:
        res = acc
    else:
        res = tl.sum(acc, 0)[None, :]  # (1, BLOCK_N); BLOCK_M is 1
    store_split_k_output(res, out_ptr, bias_ptr, ws_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid_n, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def block_k_for(group_size: int) -> int:
    """The largest step (inputs) of 128 / 64 / 32 / 16 that divides the group size."""
    for b in (128, 64, 32, 16):
        if group_size % b == 0:
            return b
    raise ValueError(f"group size {group_size} is not a multiple of 16 (the W4A16 kernels' smallest K step)")


def wna16_gemv_config(m: int, n: int, k: int, group_size: int, bits: int) -> WNA16GemvConfig:
    """Launch configuration, from the H200 sweep of scripts/gpu_quant_speed.py (2026-12-01, Llama-3.1-8B
    qkv / o / gate_up / down, int4 g128, CUDA graphs): the best configs were
        M = 1       BLOCK_N 128, 8 warps, 3 stages, K split until >= 512 programs (down: 16 splits,
                    gate_up 4, qkv and o 8, the cap of >= 4 steps a split)
        M = 2..16   BLOCK_N 256, 4 warps, 2 stages, >= 192 programs (down 16, gate_up 2, qkv / o 8)
    One group-sized step (BLOCK_K = G up to 128).
    """
    block_k = block_k_for(group_size)
    if bits == 8:
        # 16 word rows a step, as 4-bit's 128 inputs: 8-bit's 32-row tile (128 inputs) spilled registers at
        # M = 1, 8 warps (tests/kernels/sm90_compile_check.py, tenth session). Groups stay whole steps.
        block_k = min(block_k, 64)
    block_kp = block_k // (32 // bits)
    if m == 1:
        block_n, target, warps, stages = 128, 512, 8, 3
    else:
        block_n, target, warps, stages = 256, 192, 4, 2
    n_blocks = triton.cdiv(n, block_n)
    steps = k // block_k
    split = 1
    while n_blocks * split < target and split * 8 <= steps:
        split *= 2
    return WNA16GemvConfig(block_n, block_kp, split, warps, stages)


def wna16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
               group_size: int, bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
               config: WNA16GemvConfig | None = None) -> torch.Tensor:
    """x (M <= 64, K), unit stride along K -> (M, N). perm (K,) int32/int64 (act-order): weight row k is
    input perm[k]; the kernel reads x through it (a few hundred bytes a step, from L2) instead of a
    separate gather launch."""
    m, k = x.shape
    n = qweight.shape[1]
    pf = 32 // bits
    if x.stride(1) != 1:
        x = x.contiguous()
    if not 1 <= m <= KERNEL_MAX_M:
        raise ValueError(f"wna16_gemv takes 1..{KERNEL_MAX_M} rows, got {m}")
    if qweight.shape[0] * pf != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * pf}")
    cfg = config or wna16_gemv_config(m, n, k, group_size, bits)
    block_k = cfg.BLOCK_KP * pf
    if group_size % block_k or k % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size} and K {k}")
    n_blocks = triton.cdiv(n, cfg.BLOCK_N)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    split, k_per_split, ws = split_k_plan(_workspaces, out, k // block_k, block_k, cfg.SPLIT_K, n_blocks, _WS_FLOATS,
                                          _WS_COUNTERS)
    use_dot = m > 1
    _wna16_gemv_kernel[(n_blocks, split)](
        x, qweight, scales, zeros, bias if bias is not None else out, perm if perm is not None else out,
        out, ws[0], ws[1],
        m, n, k, x.stride(0), out.stride(0), k_per_split, split,
        GROUP_SIZE=group_size, BITS=bits, HAS_BIAS=bias is not None, HAS_PERM=perm is not None, USE_DOT=use_dot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no TF32 rounding
        BLOCK_M=max(16, triton.next_power_of_2(m)) if use_dot else 1, BLOCK_N=cfg.BLOCK_N, BLOCK_KP=cfg.BLOCK_KP, USE_SPLIT=split > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
