"""Fused MoE on the GPU: the experts of a step as two grouped GEMMs, with no host sync (CUDA graphs).

    1. moe_align_block_size (kernels/moe_align.py; the torch reference beside it): sort the T * top_k
       (token, slot) pairs by expert and pad each expert's run to a multiple of BLOCK_M, so every
       BLOCK_M rows of the sorted list belong to one expert.
    2. _fused_moe_kernel (kernels/moe_grouped_gemm.py): GEMM 1 (+ SiLU-and-mul), GEMM 2 (x the routed
       weight) over the sorted rows, a program per BLOCK_M rows x BLOCK_N columns of one expert.
    3. combine (kernels/moe_sum.py): the top_k rows of each token summed -> (T, hidden).

Decode-sized steps (`_scan_config`, kernels/moe_row_lists.py) replace step 1 with per-expert row
lists and GEMMs that take each expert's list. This module picks the path and its tiles
(`fused_experts`); the kernels' modules hold the kernels, their launches and their references.

Each expert's weights are read once per step however many tokens it got (the kernel's floor is the
bytes of the experts hit). FP8 experts (w13_scale / w2_scale given, quantization/fp8_moe.py) run the
same GEMMs' W_SCALED variant: fp8 weight tiles converted to the activations' dtype in the kernel, the
expert's scale on the accumulator (weight-only, W8A16; half the weight bytes of bf16), on both the
sorted-list and the row-list paths; never the TMA tiles. The plain PyTorch reference is `pagedllm.layers.fused_moe.torch_ref`.
"""

from __future__ import annotations

import torch

from pagedllm.envs import kernel_switches
from pagedllm.kernels.activation import silu_and_mul

# The kernels and launches live beside their references in these modules; callers (scripts/, tests/)
# also import them from here, as before the split.
from pagedllm.kernels.moe_align import (  # noqa: F401
    ALIGN_KERNEL_MAX_PAIRS,
    ALIGN_ROWS_MIN_PAIRS,
    _max_padded,
    _moe_align_kernel,
    _moe_expert_rows_kernel,
    _moe_rows_to_sorted_kernel,
    moe_align_block_size,
    moe_align_block_size_ref,
    moe_align_block_size_rows,
)
from pagedllm.kernels.moe_grouped_gemm import (  # noqa: F401
    FUSED_SILU_MAX_TILE,
    TensorDescriptor,
    _config,
    _fused_moe_kernel,
    _fused_moe_tma_kernel,
    _grouped_gemm,
    down_config,
)
from pagedllm.kernels.moe_row_lists import (  # noqa: F401
    _SCAN_ENABLED,
    SCAN_MAX_MEAN_ROWS,
    SCAN_MAX_PAIRS,
    _fused_experts_scan,
    _fused_moe_rows_kernel,
    _scan_config,
)
from pagedllm.kernels.moe_sum import _moe_sum_kernel, moe_sum  # noqa: F401

__all__ = ["fused_experts", "moe_align_block_size", "moe_align_block_size_ref", "moe_align_block_size_rows", "moe_sum"]

# Read once at import: PAGEDLLM_MOE_SCAN_SHARED=1 lets blocks with shared experts (DeepSeek) take the row lists too.
_SCAN_SHARED = _SCAN_ENABLED and kernel_switches().moe_scan_shared


def fused_experts(
    x: torch.Tensor,  # (T, hidden)
    w13: torch.Tensor,  # (E, 2 * inter, hidden)
    w2: torch.Tensor,  # (E, hidden, inter)
    topk_weights: torch.Tensor,  # (T, top_k) float32
    topk_ids: torch.Tensor,  # (T, top_k) int32
    config: dict | None = None,  # tile sizes (scripts/moe_config_sweep.py); None: _config's.
    # Optional keys: GROUP_M (row blocks per program group, 8), FUSE_SILU (by tile size: see above),
    # DOWN (GEMM 2's own BLOCK_N / BLOCK_K / num_warps / num_stages / GROUP_M / TMA: see down_config),
    # TMA (weight tiles by the TMA unit, `_fused_moe_tma_kernel`; 16-bit weights), SCAN (per-expert
    # row lists instead of the sorted list: `_fused_moe_rows_kernel`; BLOCK_M is the rows per pass).
    # (A persistent grid walking the tiles measured no faster on the H200, BENCHMARKS.md h49, and was dropped.)
    shared_experts: int = 0,  # the last S experts take every token (DeepSeek's, stacked); the row lists
    # only with PAGEDLLM_MOE_SCAN_SHARED=1 or a SCAN config
    sum_topk: bool = True,  # False: each token's top_k expert outputs unsummed, (T, top_k, hidden), for a
    # consumer that sums them itself (kernels/rmsnorm.py: the next residual add + norm)
    w13_scale: torch.Tensor | None = None,  # (E,) float32: FP8 experts (float8_e4m3fn w13 / w2, W8A16), one
    w2_scale: torch.Tensor | None = None,  # scale per expert and GEMM (quantization/fp8_moe.py); both or neither
) -> torch.Tensor:  # (T, hidden), or (T, top_k, hidden) with sum_topk=False
    t, top_k = topk_ids.shape
    e, two_inter, hidden = w13.shape
    if x.shape != (t, hidden) or w2.shape != (e, hidden, two_inter // 2):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"and topk_ids {tuple(topk_ids.shape)} do not agree")
    if not (x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_experts needs row-major x and contiguous expert weights")
    fp8 = _check_fp8_experts(w13, w2, w13_scale, w2_scale)
    if t == 0:
        return torch.zeros_like(x) if sum_topk else x.new_zeros((0, top_k, hidden))
    # Tiles by the dtype the dots run in: the weights', or for FP8 experts the activations' (fp8 tiles
    # are converted to it in the kernel). FP8 experts take the pointer kernel (no TMA tiles).
    tile_dtype = x.dtype if fp8 else w13.dtype
    if config is None and shared_experts and _SCAN_SHARED:  # the routed experts' pairs pick the row-list tiles
        config = _scan_config(t * (top_k - shared_experts), e - shared_experts, tile_dtype)
    cfg = (config or (None if shared_experts else _scan_config(t * top_k, e, tile_dtype))
           or _config(t * top_k, tile_dtype))
    if fp8 and cfg.get("TMA"):
        cfg = {k: v for k, v in cfg.items() if k != "TMA"}
    weights = topk_weights.reshape(-1).float().contiguous()
    if cfg.get("SCAN"):
        scales = (w13_scale, w2_scale) if fp8 else ()  # the unquantized call as it was
        down = _fused_experts_scan(x, w13, w2, weights, topk_ids, cfg, shared_experts, *scales)
        return moe_sum(down, top_k) if sum_topk else down.view(t, top_k, hidden)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e)
    if cfg.get("FUSE_SILU", cfg["BLOCK_M"] * cfg["BLOCK_N"] <= FUSED_SILU_MAX_TILE):
        h = torch.empty((t * top_k, two_inter // 2), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, h, weights, sorted_ids, expert_ids, ntpp, top_k, False, cfg, fuse_silu=True,
                      w_scale=w13_scale)
    else:
        gate_up = torch.empty((t * top_k, two_inter), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, ntpp, top_k, False, cfg, w_scale=w13_scale)
        h = silu_and_mul(gate_up)  # (T * top_k, inter)
    down = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, down, weights, sorted_ids, expert_ids, ntpp, 1, True, down_config(cfg), w_scale=w2_scale)
    return moe_sum(down, top_k) if sum_topk else down.view(t, top_k, hidden)


def _check_fp8_experts(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                       w2_scale: torch.Tensor | None) -> bool:
    """Whether the experts are FP8 (scales given); ValueError naming what is off: fp8 weights without
    scales, scales with 16-bit weights, or scales not (E,) float32 contiguous."""
    fp8 = torch.float8_e4m3fn
    if w13_scale is None and w2_scale is None:
        if w13.dtype == fp8 or w2.dtype == fp8:
            raise ValueError("fused_experts: float8_e4m3fn expert weights need w13_scale and w2_scale")
        return False
    if w13_scale is None or w2_scale is None:
        raise ValueError("fused_experts: FP8 experts need both w13_scale and w2_scale")
    if w13.dtype != fp8 or w2.dtype != fp8:
        raise ValueError(f"fused_experts: weight scales come with float8_e4m3fn experts, got {w13.dtype} / {w2.dtype}")
    e = w13.shape[0]
    for name, s in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if s.shape != (e,) or s.dtype != torch.float32 or not s.is_contiguous():
            raise ValueError(f"fused_experts: {name} must be ({e},) float32 contiguous (one scale per expert), got "
                             f"{tuple(s.shape)} {s.dtype}")
    return True
