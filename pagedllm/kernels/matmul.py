"""Tile GEMM for mid-sized decode batches: y = x @ W^T (+ bias) with 16..512 rows in x.

Why. At batch ~256 a decode step's linears are compute bound, and cuBLAS picks tilings that leave
the H200 half idle there: Llama-3.1-8B at M = 256 measured qkv 393, o_proj 279, gate_up 624 and
down 567 TFLOP/s (`scripts/gemm_bench.py`), 7.2 ms of GEMMs per step where ~4.7 would do; at
M = 8192 (prefill) the same shapes run at 700-790 and stay with cuBLAS.

Work split. x is (M, K), W is (N, K) row-major (nn.Linear's layout). Program (pid, pk) owns a
(BLOCK_M, BLOCK_N) output tile and the K range [pk * K_PER_SPLIT, +K_PER_SPLIT). Tiles are
numbered in groups of GROUP_M row-tiles (Triton's matmul tutorial) so programs running together
share W tiles in L2. Out-of-range rows and columns are wrapped (row r reads row r % M), so the
inner loop has no masks when K is a multiple of BLOCK_K; only the store is masked.

Split-K. With few output tiles (o_proj at M = 256: 2 x 32 tiles of 128 x 128 for 132 SMs),
SPLIT_K programs share a tile and write fp32 partials (SPLIT_K, M, N) to a workspace; a second
kernel sums them in split order (deterministic) and adds the bias. The workspace comes from the
caching allocator per call, so CUDA-graph capture records it like any activation.

CUDA graphs: the grid depends on shapes only; M is not specialised on (one compiled variant per
config for every batch size). Reference: `tile_linear_ref`. Dispatch rule: `use_tile_linear`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["MatmulConfig", "matmul_config", "tile_linear", "tile_linear_ref", "use_tile_linear"]

# Read once at import: PAGEDLLM_TILE_GEMM=0 sends these batches back to F.linear (cuBLAS).
_ENABLED = os.environ.get("PAGEDLLM_TILE_GEMM", "1") != "0"

# Batch sizes this kernel takes; below, the skinny GEMV or cuBLAS; above, cuBLAS (prefill).
_MIN_M = 16
_MAX_M = 512


class MatmulConfig(NamedTuple):
    """One launch configuration; see `matmul_config`."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int  # programs sharing one output tile (1 = no split)
    num_warps: int
    num_stages: int
    GROUP_M: int = 8


@triton.jit(do_not_specialize=["M"])
def _tile_linear_kernel(
    x_ptr,  # (M, K), unit stride along K
    w_ptr,  # (N, K), unit stride along K
    bias_ptr,  # (N,); only read when HAS_BIAS and not USE_SPLIT
    out_ptr,  # (M, N); unused when USE_SPLIT
    part_ptr,  # fp32 (SPLIT_K, M, N); only when USE_SPLIT
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    K_PER_SPLIT,  # multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no masks in the loop
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row-tiles walk the columns together. Example, 2 row-tiles and
    # 4 column-tiles: pids 0..7 -> (0,0) (1,0) (0,1) (1,1) (0,2) (1,2) (0,3) (1,3).
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m % M  # wrapped: always in range, never stored
    cols = offs_n % N
    k_start = pid_k * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_mask = (k0 + offs_k) < k_end
            x = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if USE_SPLIT:
        part = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
        tl.store(part, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    part_ptr,  # fp32 (SPLIT_K, M, N)
    bias_ptr,
    out_ptr,  # (M, N)
    M,
    N,
    stride_om,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per BLOCK outputs of one row: sum the partials in split order.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _split_k(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """(splits, K per split): whole BLOCK_K steps per split, none left empty.

    K=4096, BLOCK_K=64 asked for 3 splits -> 22 steps each -> (3, 1408).
    """
    k_per_split = max(block_k, triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k)
    return max(1, triton.cdiv(k, k_per_split)), k_per_split


def tile_linear(
    x: torch.Tensor,  # (M, K)
    weight: torch.Tensor,  # (N, K), nn.Linear layout
    bias: torch.Tensor | None = None,  # (N,)
    config: MatmulConfig | None = None,  # default: matmul_config(M, N, K)
) -> torch.Tensor:
    """y = x @ weight^T (+ bias), (M, N) in x's dtype, accumulated in fp32."""
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"expected x (M, K) and weight (N, K), got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"x has K={k} but weight is {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"dtype mismatch: x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else bias.dtype}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    cfg = config or matmul_config(m, n, k)
    split_k, k_per_split = _split_k(k, cfg.BLOCK_K, cfg.SPLIT_K)
    use_split = split_k > 1
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if use_split else out
    grid = (triton.cdiv(m, cfg.BLOCK_M) * triton.cdiv(n, cfg.BLOCK_N), split_k)
    _tile_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        part,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        k_per_split,
        HAS_BIAS=bias is not None,
        USE_SPLIT=use_split,
        EVEN_K=k % cfg.BLOCK_K == 0,  # then every split's range is whole BLOCK_K steps too
        BLOCK_M=cfg.BLOCK_M,
        BLOCK_N=cfg.BLOCK_N,
        BLOCK_K=cfg.BLOCK_K,
        GROUP_M=cfg.GROUP_M,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if use_split:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            part,
            bias if bias is not None else part,
            out,
            m,
            n,
            out.stride(0),
            SPLIT_K=split_k,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out


def tile_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain PyTorch twin of `tile_linear`: F.linear in fp32, cast to x's dtype."""
    b = bias.float() if bias is not None else None
    return F.linear(x.float(), weight.float(), b).to(x.dtype)


# Tuned configs: (n, k) -> [(max_m, config or None), ...] ascending in max_m. The first entry whose
# max_m covers M decides: a config runs this kernel, None (or no entry: shapes and batch sizes not
# listed) leaves the linear to cuBLAS. From the H200 sweep of `scripts/gemm_bench.py`.
_TUNED: dict[tuple[int, int], list[tuple[int, MatmulConfig | None]]] = {}


def _lookup(m: int, n: int, k: int) -> MatmulConfig | None:
    for max_m, cfg in _TUNED.get((n, k), ()):
        if m <= max_m:
            return cfg
    return None


def matmul_config(m: int, n: int, k: int) -> MatmulConfig:
    """The tuned config for this shape and batch size, else a general-purpose one."""
    cfg = _lookup(m, n, k)
    if cfg is not None:
        return cfg
    if m <= 64:
        return MatmulConfig(64, 64, 128, 1, 4, 4)
    return MatmulConfig(128, 128, 64, 1, 8, 4)


def use_tile_linear(m: int, n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether a CUDA linear of x (m, k) and W (n, k) should run `tile_linear` instead of cuBLAS:
    bf16/fp16, _MIN_M <= m <= _MAX_M, and a measured win for this shape at this batch size (a
    `_TUNED` config). The caller checks that the tensors are on CUDA."""
    if not (_ENABLED and dtype in (torch.bfloat16, torch.float16) and _MIN_M <= m <= _MAX_M):
        return False
    return _lookup(m, n, k) is not None
