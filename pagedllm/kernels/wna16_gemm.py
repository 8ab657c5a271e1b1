"""W4A16 / W8A16 dequant-GEMM for AWQ, GPTQ and compressed-tensors pack-quantized weights.

Every int-weight method repacks its checkpoint at load time into one layout this kernel reads:

    qweight (K // pf, N) int32   pf = 32 // bits values of consecutive k in one word, value of k at
                                 bits [(k % pf) * bits, +bits) of row k // pf (GPTQ's own layout),
                                 unsigned 0 .. 2^bits - 1; N contiguous, so a tile row is one
                                 coalesced load across output columns
    scales  (K // G, N)          one scale per group of G inputs and output column (checkpoint dtype)
    zeros   (K // G, N) uint8    zero points, unsigned (GPTQ v1's off-by-one and AWQ's nibble order
                                 are undone at repack)
    perm    (K,) int64 or None   act-order (GPTQ desc_act): the checkpoint's inputs sorted by group,
                                 so groups are contiguous; x is gathered x[:, perm] before the GEMM

    w[k, n] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n];   y = x @ w + bias

Worked example, bits 4, G 4, K 8, N 1: qweight [[0x00003A21]] holds q = [1, 2, 10, 3, 0, 0, 0, 0]
for k = 0..7; scales [[0.5], [0.25]], zeros [[8], [8]] -> w = [-3.5, -3, 1, -2.5, -2, -2, -2, -2].

CUDA paths (`wna16_linear`), none keeping a dense copy of the weight between calls:
    M == 1, int4, G % 128 == 0              kernels/wna16_stream.py: short unrolled programs, many in
                   flight (split-K with an ordered one-launch reduce), fp32 magic-number unpack or
                   packed fp16 math on pairs of values (MATH="f16x2"); its (N, K) table picks per shape
    M >= 2, int4, G % 128 == 0, 16-bit x    kernels/wna16_mma.py where its launch table / rule
                   (wna16_mma_config.py) has a configuration (to 128-1024 rows by shape): one wgmma a
                   128-input step, the weights dequantized in registers as its register operand
    M < 128, int4, G % 128 == 0, 16-bit x   (else, and with PAGEDLLM_WNA16_MMA=0) kernels/wna16_tc.py:
                   LOP3-unpacked words straight into tensor-core dots, split-K for skinny batches
                   (act-order: x read through perm)
    M <= 16        (other int4 groups, 8-bit) kernels/wna16_gemv.py: the words streamed once, unpacked
                   in registers (split-K)
    16 < M < 128   (same) `_wna16_gemm_kernel`: (BLOCK_M, BLOCK_N) tiles; each step loads its (BLOCK_KP,
                   BLOCK_N) words once, unpacks them into a (BLOCK_K, BLOCK_N) tile in natural order
                   (kernels/wna16_unpack.py) and runs one tensor-core dot on the x tile (act-order:
                   x gathered once per call); split-K for M <= 64
    M >= 128       `dequantize_wna16_triton` to a scratch in x's dtype, then cuBLAS (the scratch is
                   freed after the call; at these M the GEMM's cost dwarfs the dequantization)
The values are unpacked without int -> float conversions (see wna16_gemv) and the group scale is
applied once per step to the fp32 partial sums.

Reference: `wna16_linear_ref` (dequantize to fp32, matmul in fp32); it is also the CPU path.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.envs import environment_variables
from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.wna16_gemv import MAX_M as MAX_GEMV_M
from pagedllm.kernels.wna16_gemv import block_k_for, wna16_gemv
from pagedllm.kernels.wna16_mma import mma_supported, wna16_mma_linear
from pagedllm.kernels.wna16_mma_config import mma_choice
from pagedllm.kernels.wna16_stream import stream_supported, wna16_stream_linear
from pagedllm.kernels.wna16_tc import tc_supported, wna16_tc_linear
from pagedllm.kernels.wna16_unpack import unpack_scaled, unpack_tile
from pagedllm.kernels.wna16_wgmma_config import wgmma_choice

__all__ = ["dequantize_wna16", "dequantize_wna16_triton", "pack_along_k", "unpack_along_k", "wna16_linear",
           "wna16_linear_ref"]


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """(K, N) unsigned values (any int dtype) -> (K // pf, N) int32 in the layout above."""
    pf = 32 // bits
    k, n = q.shape
    if k % pf:
        raise ValueError(f"{k} inputs do not pack into int32 words of {pf} {bits}-bit values")
    q = q.to(torch.int64).reshape(k // pf, pf, n)
    shifts = (torch.arange(pf, device=q.device, dtype=torch.int64) * bits).view(1, pf, 1)
    words = (q << shifts).sum(dim=1)  # disjoint bit ranges: the sum is the bitwise or
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement view of the high bit


def unpack_along_k(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """(K // pf, N) int32 -> (K, N) int32 unsigned values; inverse of `pack_along_k`."""
    pf = 32 // bits
    shifts = (torch.arange(pf, device=qweight.device, dtype=torch.int32) * bits).view(1, pf, 1)
    vals = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(qweight.shape[0] * pf, qweight.shape[1])


def dequantize_wna16(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                     group_size: int) -> torch.Tensor:
    """The (K, N) float32 weight of the layout above (K in the sorted order when perm is used)."""
    q = unpack_along_k(qweight, bits).float()
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return (q - zeros.float()[g]) * scales.float()[g]


def wna16_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     bits: int, group_size: int, perm: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) -> (M, N) in x's dtype, computed in fp32 (the CPU path and the kernel's reference)."""
    if perm is not None:
        x = x[:, perm]
    out = x.float() @ dequantize_wna16(qweight, scales, zeros, bits, group_size)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@triton.jit
def _wna16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, z_ptr, out_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_om, stride_os,
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KP: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = BLOCK_KP * PF
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    pk = tl.program_id(2)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = tl.arange(0, BLOCK_KP)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pk * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    for k0 in range(k_start, k_end, BLOCK_K):
        # Each word loaded once, unpacked to a (BLOCK_K, BLOCK_N) tile of q in natural order, one dot
        # against the contiguous x tile; zero point and scale meet the step's sums (wna16_gemv).
        words = tl.load(qw_ptr + ((k0 // PF) + offs_kp)[:, None].to(tl.int64) * N + offs_n[None, :],
                        mask=n_mask[None, :], other=0)
        q = unpack_tile(words, BITS, BLOCK_K, BLOCK_N)
        x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_mask[:, None], other=0.0)
        part = tl.dot(x, q.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
        xsum = tl.sum(x.to(tl.float32), axis=1)
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        acc += (part - xsum[:, None] * z[None, :]) * s[None, :]
    tl.store(out_ptr + pk * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _wna16_dequant_kernel(qw_ptr, s_ptr, z_ptr, out_ptr, N, GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
                          BLOCK_KP: tl.constexpr, BLOCK_N: tl.constexpr):
    PF: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = 16 // BITS
    kp0 = tl.program_id(0) * BLOCK_KP
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kp = kp0 + tl.arange(0, BLOCK_KP)
    n_mask = offs_n < N
    words = tl.load(qw_ptr + offs_kp[:, None].to(tl.int64) * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    hi = words >> 16
    g = (kp0 * PF) // GROUP_SIZE
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
    for j in tl.static_range(PF):
        fac = 1 << (BITS * (j % HALF))
        w = (unpack_scaled(words, hi, j, BITS) - (8388608.0 + z * fac)[None, :]) * (s * (1.0 / fac))[None, :]
        rows = (offs_kp * PF + j).to(tl.int64)
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=n_mask[None, :])


def dequantize_wna16_triton(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                            group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The (K, N) weight in `dtype` (a scratch for large-M GEMMs); same values as `dequantize_wna16`."""
    kp, n = qweight.shape
    block_kp = block_k_for(group_size) // (32 // bits)
    out = torch.empty((kp * (32 // bits), n), dtype=dtype, device=qweight.device)
    _wna16_dequant_kernel[(kp // block_kp, triton.cdiv(n, 128))](
        qweight, scales, zeros, out, n, GROUP_SIZE=group_size, BITS=bits, BLOCK_KP=block_kp, BLOCK_N=128)
    return out


def wna16_config(m: int, n: int, k: int, group_size: int, bits: int = 4) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) of the tensor-core kernel: split K
    until >= 200 programs while M <= 64 (H200 sweep, M = 64: gate_up's 224 tiles best unsplit, qkv /
    o / down split 4-16), 3 stages."""
    block_k = block_k_for(group_size)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 32 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    steps = triton.cdiv(k, block_k)
    while tiles * split < 200 and split * 2 <= steps and m <= 64:
        split *= 2
    return block_m, block_n, block_k, split, 4, 3


# From this many rows on, the weight is dequantized to a scratch in x's dtype (freed after the call) and
# multiplied by cuBLAS; below it the tensor-core kernel reads the int4 words directly. H200, Llama-3.1-8B
# shapes (scripts/gpu_quant_speed.py, 2026-12-01): at M = 256 the scratch path took 40 / 27 / 171 / 88 us
# (qkv / o / gate_up / down) against the tile kernel's 90 / 59 / 342 / 174 at its best config; at M = 64
# the two were within 30% either way.
DEQUANT_MIN_M = 128
# Int4 with groups of 128 (or multiples) and 16-bit activations go to the tensor-core kernel
# (kernels/wna16_tc.py) up to TC_MAX_M rows, and up to TC_MAX_M_LARGE rows for weights of at least
# TC_LARGE_WEIGHTS values; beyond that to the dequantized scratch (faster there than the tile kernel
# above). Picked from the H200 sweep of the 8B linears: BENCHMARKS.md, issue 19, the h32 subsection.
TC_ENABLED = environment_variables["PAGEDLLM_WNA16_TC"]()
STREAM_ENABLED = environment_variables["PAGEDLLM_WNA16_STREAM"]()
MMA_ENABLED = environment_variables["PAGEDLLM_WNA16_MMA"]()
WGMMA_ENABLED = environment_variables["PAGEDLLM_WNA16_WGMMA"]()
TC_MAX_M = 64
TC_MAX_M_LARGE = 128
TC_LARGE_WEIGHTS = 40 << 20  # gate_up (28672 x 4096) and down (4096 x 14336) of the 8B; not qkv / o


@functools.cache
def _wgmma():
    """kernels/wna16_wgmma.py, imported on first use: Gluon's import is kept off the start of engines
    whose weights never reach it (no int4 weights, no sm_90 GPU)."""
    from pagedllm.kernels import wna16_wgmma

    return wna16_wgmma


def tc_max_m(n: int, k: int) -> int:
    """The most rows the tensor-core kernel takes for an (N, K) int4 weight (0 when switched off)."""
    if not TC_ENABLED:
        return 0
    return TC_MAX_M_LARGE if n * k >= TC_LARGE_WEIGHTS else TC_MAX_M


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group_size: int, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
                 dequant_min_m: int | None = None, act: str | None = None) -> torch.Tensor:
    """CUDA (or the interpreter) x (M, K) -> (M, N) in x's dtype; same contract as `wna16_linear_ref`.

    One row, int4 g128: `wna16_stream_linear`. Int4 with 16-bit x on sm_90: `wna16_wgmma_linear` where
    `wgmma_choice` has a measured configuration. Int4 g128 with 16-bit x: `wna16_mma_linear` where
    `mma_choice` has a configuration (2 up to 128-1024 rows by shape), else `wna16_tc_linear` up to `tc_max_m` rows (and below `dequant_min_m`;
    act-order: x read through perm up to 16 rows, gathered once above), then the dequantized scratch.
    Otherwise M <= 16: `wna16_gemv` (weight streaming; act-order reads x through perm), larger M:
    the tile kernel on the packed words (act-order: x gathered by perm once); from `dequant_min_m`
    rows (default DEQUANT_MIN_M) a dequantized scratch and cuBLAS.
    `config` (tests, tuning) forces the tile kernel: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K[, num_warps,
    num_stages]).
    act "silu_and_mul": x is (M, 2K) = [gate | up] and the inputs are silu(gate) * up (SwiGLU's down
    projection): the one-row kernel computes them in its prologue, other paths run the activation first.
    """
    if act is not None:
        if x.shape[0] == 1 and config is None and STREAM_ENABLED and bits == 4 and stream_supported(
                x, bits, group_size, qweight.shape[0] * 8):
            return wna16_stream_linear(x, qweight, scales, zeros, group_size, bias, perm, act=act)
        if act != "silu_and_mul":
            raise ValueError(f"activation {act!r} not built (silu_and_mul)")
        x = silu_and_mul(x)
    m, k = x.shape
    n = qweight.shape[1]
    pf = 32 // bits
    if qweight.shape[0] * pf != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * pf}")
    dequant_from = DEQUANT_MIN_M if dequant_min_m is None else dequant_min_m
    if config is None and STREAM_ENABLED and stream_supported(x, bits, group_size, k):
        return wna16_stream_linear(x, qweight, scales, zeros, group_size, bias, perm)
    # act-order at <= 16 rows stays on the tensor-core kernel, which reads x through perm in the kernel:
    # the GEMM below gathers x once per call (one more launch a linear), not measured against it there
    if config is None and WGMMA_ENABLED and x.is_cuda and (perm is None or m > MAX_GEMV_M):
        wg = wgmma_choice(m, n, k)
        if wg is not None and _wgmma().wgmma_supported(x, k, group_size, bits):
            return _wgmma().wna16_wgmma_linear(x, qweight, scales, zeros, group_size, wg, bias, perm)
    if config is None and MMA_ENABLED and mma_supported(x, bits, group_size, k) and (
            perm is None or m > MAX_GEMV_M):
        mma = mma_choice(m, n, k)
        if mma is not None:
            return wna16_mma_linear(x, qweight, scales, zeros, group_size, bias, perm, config=mma)
    if config is None and tc_supported(x, bits, group_size, k) and tc_max_m(n, k):
        limit = tc_max_m(n, k)
        if m <= limit and m < dequant_from:
            # act-order: in-kernel reads through perm are cheap for a few rows; gathered x tiles of many
            # rows are ~10x slower (BENCHMARKS.md), so larger batches gather x once
            if perm is not None and m > MAX_GEMV_M:
                x, perm = x.index_select(1, perm), None
            return wna16_tc_linear(x, qweight, scales, zeros, group_size, bias, perm)
        if dequant_min_m is None:
            dequant_from = limit + 1  # past the tensor-core kernel: the scratch (the tile kernel is slower)
    if m <= MAX_GEMV_M and config is None:
        return wna16_gemv(x, qweight, scales, zeros, bits, group_size, bias, perm)
    if config is None and m >= dequant_from:
        w = dequantize_wna16_triton(qweight, scales, zeros, bits, group_size, x.dtype)
        xs = x if perm is None else x.index_select(1, perm)
        out = torch.matmul(xs, w)
        return out if bias is None else out + bias
    block_m, block_n, block_k, split, *launch = config or wna16_config(m, n, k, group_size, bits)
    num_warps, num_stages = launch if launch else (4, 2)
    if group_size % block_k or block_k % pf:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size}")
    xs = (x if perm is None else x.index_select(1, perm)).contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _wna16_gemm_kernel[grid](
        xs, qweight, scales, zeros, partial, m, n, k, k_per_split,
        xs.stride(0), partial.stride(1), partial.stride(0),
        GROUP_SIZE=group_size, BITS=bits,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KP=block_k // pf, num_warps=num_warps, num_stages=num_stages,
    )
    out = partial[0] if split == 1 else partial.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
