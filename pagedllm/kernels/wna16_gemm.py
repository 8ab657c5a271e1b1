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

The kernel: program (pm, pn, pk) owns rows [pm*BM, +BM), columns [pn*BN, +BN) and a K range; each
BLOCK_K step loads the packed words of its (BLOCK_K, BN) tile (each word pf times, from L1), one
scale / zero row (BLOCK_K divides G, so a step lies in one group), shifts + masks the values out,
dequantizes in fp32, casts to x's dtype and accumulates x @ w on tensor cores in fp32. Skinny
(decode) batches split K over SPLIT_K programs writing fp32 partials that are summed after.

Reference: `wna16_linear_ref` (dequantize to fp32, matmul in fp32); it is also the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["dequantize_wna16", "pack_along_k", "unpack_along_k", "wna16_linear", "wna16_linear_ref"]


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
    GROUP_SIZE: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PF: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    pk = tl.program_id(2)
    offs_m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pk * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        words = tl.load(qw_ptr + (offs_k // PF)[:, None] * N + offs_n[None, :],
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
        q = (words >> ((offs_k % PF) * BITS)[:, None]) & MASK
        g = k0 // GROUP_SIZE
        s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g * N + offs_n, mask=n_mask, other=0).to(tl.float32)
        w = (q.to(tl.float32) - z[None, :]) * s[None, :]
        w = tl.where(k_mask[:, None], w, 0.0)
        acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)
    tl.store(out_ptr + pk * stride_os + offs_m[:, None] * stride_om + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])


def _block_k(group_size: int) -> int:
    for b in (128, 64, 32, 16):
        if group_size % b == 0:
            return b
    raise ValueError(f"group size {group_size} is not a multiple of 16 (the W4A16 kernel's smallest K step)")


def wna16_config(m: int, n: int, k: int, group_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K): skinny batches split K until there are ~2 programs per SM."""
    block_k = _block_k(group_size)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 32 else 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    steps = triton.cdiv(k, block_k)
    while tiles * split < 264 and split * 2 <= steps and m <= 64:
        split *= 2
    return block_m, block_n, block_k, split


def wna16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bits: int, group_size: int, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The Triton kernel: x (M, K) -> (M, N) in x's dtype; same contract as `wna16_linear_ref`."""
    if perm is not None:
        x = x[:, perm]
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.shape[0] * (32 // bits) != k:
        raise ValueError(f"x has {k} inputs, the packed weight {qweight.shape[0] * (32 // bits)}")
    block_m, block_n, block_k, split = config or wna16_config(m, n, k, group_size)
    if group_size % block_k:
        raise ValueError(f"BLOCK_K {block_k} must divide the group size {group_size}")
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per_split)
    partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _wna16_gemm_kernel[grid](
        x, qweight, scales, zeros, partial, m, n, k, k_per_split,
        x.stride(0), partial.stride(1), partial.stride(0),
        GROUP_SIZE=group_size, BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    out = partial[0] if split == 1 else partial.sum(0)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
