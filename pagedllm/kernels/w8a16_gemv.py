"""8-bit weights, 16-bit activations, for decode batches: stream fp8 / int8 weights once, dequantize in registers.

    out (M, N) = (x (M, K) @ wq (N, K)^T) * w_scale[None, :] (+ bias)     x bf16/fp16/fp32, M <= 64

Why: at M <= 16 a linear is weight streaming, and W8A8's two launches lose there on the H200
(BENCHMARKS.md, issue 19: FP8 `_scaled_mm` at M = 1 qkv 21 us, down 46 against bf16 15 / 34): the
activation-quantization kernel is one more launch per linear and cuBLASLt's FP8 GEMM is not built for
one row. Reading 1-byte weights is half bf16's bytes; converting them in registers costs nothing the
memory system waits for. Activations are not quantized here at all, so the result is the weights'
exact dequantized product (closer to the bf16 model than W8A8: the activations keep 16 bits).

Layout: wq (N, K) row-major, nn.Linear's; nothing repacked. A step loads a (BLOCK_N, BLOCK_K) tile:
BLOCK_N rows of BLOCK_K contiguous bytes (16-byte vector loads), converts it to x's dtype (fp8 e4m3
and int8 are exact in bf16) and multiplies:

    DOT  (M >= 2; x padded to 16 rows)  acc (BLOCK_M, BLOCK_N) fp32 += x @ w^T on tensor cores
    FMA  (M == 1)                       acc (BLOCK_N, BLOCK_K) fp32 += w * x[None, :], summed over K
                                        once at the end
The per-channel scale multiplies the fp32 sums once (it is constant along K), before split-K.

Split-K: as kernels/gemv.py (whose `store_split_k_output` this reuses): N = 4096 in 64-wide blocks is
64 programs for 132 SMs, so SPLIT_K programs share an N-block and the last to arrive sums the fp32
partials in split order and adds the bias: one launch, no memset, deterministic. The workspace is
made outside any CUDA-graph capture (a capture that would make it runs SPLIT_K = 1).

Reference: `w8a16_linear_ref` (tests/kernels/test_w8a16_gemv.py, TRITON_INTERPRET=1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedllm.kernels.gemv import split_k_workspace, store_split_k_output

__all__ = ["KERNEL_MAX_M", "W8A16Config", "w8a16_config", "w8a16_linear", "w8a16_linear_ref"]

KERNEL_MAX_M = 64
_WS_FLOATS = 1 << 23  # 32 MB of fp32 split-K partials per device, allocated once
_WS_COUNTERS = 1 << 15
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


class W8A16Config(NamedTuple):
    BLOCK_N: int  # output columns (weight rows) per program
    BLOCK_K: int  # bytes of each weight row per step
    TARGET_PROGRAMS: int  # K is split until N-blocks x splits reaches this (1: never split)
    num_warps: int
    num_stages: int
    USE_DOT: bool  # tensor cores (any M); False: the FMA path (M == 1 only)


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, ws_ptr_scale, bias_ptr, out_ptr, part_ptr, counter_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, K_PER_SPLIT, SPLIT_K,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, USE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    rows_w = tl.where(mask_n, offs_n, 0).to(tl.int64)  # edge columns re-read row 0, never stored
    w_ptrs = w_ptr + rows_w[:, None] * stride_wn + (k_start + offs_k)[None, :]
    cdt = x_ptr.dtype.element_ty
    if USE_DOT:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            # Weights are read once: let them leave L2 first, x and the outputs stay.
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w.to(cdt)), acc, input_precision=DOT_PRECISION)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        res = acc
    else:
        x_ptrs = x_ptr + k_start + offs_k
        acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=mask_k[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=mask_k, other=0.0)
            acc2 += w.to(tl.float32) * x.to(tl.float32)[None, :]
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        res = tl.sum(acc2, axis=1)[None, :]  # (1, BLOCK_N); BLOCK_M is 1
    scale = tl.load(ws_ptr_scale + offs_n, mask=mask_n, other=0.0)
    res = res * scale[None, :]
    store_split_k_output(res, out_ptr, bias_ptr, part_ptr, counter_ptr, offs_m, offs_n, mask_m, mask_n, stride_om,
                         M, N, pid_k, pid_n, SPLIT_K, HAS_BIAS, USE_SPLIT, BLOCK_M, BLOCK_N)


def w8a16_config(m: int, n: int, k: int, qdtype: torch.dtype = torch.float8_e4m3fn) -> W8A16Config:
    """Launch configuration, from the H200 sweep of scripts/gpu_w8a8_sweep.py (2026-12-01, Llama-3.1-8B
    gate_up / down, CUDA graphs; BENCHMARKS.md):
        M == 1, fp8     FMA, BLOCK_N 8, BLOCK_K 512, split to >= 1024 programs: gate_up 33.7 us, down 19.5
                        (bf16 58.2 / 30.6; the tensor-core path 42.6 / 25.5)
        M == 1, int8    tensor cores, BLOCK_N 32, BLOCK_K 256, 4 stages, >= 512 programs: 35.3 / 20.6 (its
                        FMA path 40.2 / 25.0: int8 -> fp32 conversions are slow)
        M = 2..64       tensor cores, the same: int8 gate_up M = 16 36.2, fp8 43.1
    """
    if m == 1 and qdtype == torch.float8_e4m3fn:
        return W8A16Config(8, 512, 1024, 4, 3, False)
    return W8A16Config(32, 256, 512, 4, 4, True)


def _splits(k: int, block_k: int, n_blocks: int, target: int) -> tuple[int, int]:
    """(splits, K per split): powers of two while n_blocks * splits < target and each split keeps
    >= 4 BLOCK_K steps. down (K 14336, BLOCK_K 256: 56 steps), 64 N-blocks, target 256 -> 4 splits."""
    steps = triton.cdiv(k, block_k)
    split = 1
    while n_blocks * split < target and (split * 2) * 4 <= steps:
        split *= 2
    k_per_split = triton.cdiv(steps, split) * block_k
    return triton.cdiv(k, k_per_split), k_per_split


def w8a16_linear(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 config: W8A16Config | None = None) -> torch.Tensor:
    """x (M <= 64, K) float, wq (N, K) float8_e4m3fn or int8, w_scale (N,) fp32 -> (M, N) in x's dtype;
    the contract of `w8a16_linear_ref`. No host syncs (graph-capturable)."""
    if x.dim() != 2 or wq.dim() != 2 or x.shape[1] != wq.shape[1]:
        raise ValueError(f"expected x (M, K) and wq (N, K), got {tuple(x.shape)} and {tuple(wq.shape)}")
    if wq.dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"w8a16_linear takes int8 or float8_e4m3fn weights, not {wq.dtype}")
    m, k = x.shape
    n = wq.shape[0]
    if not 1 <= m <= KERNEL_MAX_M:
        raise ValueError(f"w8a16_linear takes 1..{KERNEL_MAX_M} rows, got {m}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if wq.stride(1) != 1:
        raise ValueError("w8a16_linear needs a K-contiguous weight")
    cfg = config or w8a16_config(m, n, k, wq.dtype)
    use_dot = cfg.USE_DOT or m > 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(n, cfg.BLOCK_N)
    split, k_per_split = _splits(k, cfg.BLOCK_K, n_blocks, cfg.TARGET_PROGRAMS)
    ws = split_k_workspace(_workspaces, x.device, _WS_FLOATS, _WS_COUNTERS) if split > 1 else None
    if ws is None or split * m * n > _WS_FLOATS or n_blocks > _WS_COUNTERS:
        split, k_per_split = 1, k
        ws = (out, out)  # never read: the split-K branch is compiled out
    _w8a16_gemv_kernel[(n_blocks, split)](
        x, wq, w_scale.reshape(-1), bias if bias is not None else out, out, ws[0], ws[1],
        m, n, k, x.stride(0), wq.stride(0), out.stride(0), k_per_split, split,
        HAS_BIAS=bias is not None, USE_DOT=use_dot, USE_SPLIT=split > 1,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 x: no TF32 rounding
        BLOCK_M=max(16, triton.next_power_of_2(m)) if use_dot else 1, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def w8a16_linear_ref(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch twin of `w8a16_linear`: (x @ wq^T) * w_scale (+ bias) in fp32, cast to x's dtype."""
    out = (x.float() @ wq.float().t()) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
