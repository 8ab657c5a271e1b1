"""q/k RMSNorm + neox rotary + KV-cache write in one launch, straight from the qkv GEMM output.

Per attention layer and step the unfused CUDA path runs four kernels after `qkv_proj`:
`rms_norm` on q and on k (Qwen3's per-head q_norm/k_norm), `rotary_embedding` (in place) and
`write_kv_cache`. `fused_qkv_prep` does all of it in one kernel and returns q as a new tensor;
K and V go only to the cache (the attention kernel reads them from there).

Shapes (T tokens, H query heads, KVH kv heads, D head_dim, R = rot_dim = cos_sin_cache.shape[1]):
    qkv            (T, (H + 2 * KVH) * D)   [q heads | k heads | v heads], unit stride along dim 1
    positions      (T,) int
    cos_sin_cache  (max_position, R)        [cos | sin], layout of `pagedllm.kernels.rotary`
    kv_cache       (2, num_blocks, block_size, KVH, D)
    slot_mapping   (S,) int64, S <= T       token t < S goes to slot_mapping[t] (-1 = skip);
                                            tokens t >= S (CUDA-graph padding) are not written
    returns q      (T, H, D), qkv's dtype
    in_scales      optional (row (T, 1), col ((H + 2 * KVH) * D,)) fp32: qkv is then a deferring FP8
                   qkv_proj's unscaled sums (kernels/quantized_activation.ScaledOutput), and every value is
                   read as (qkv[t, c] * row[t] * col[c]) rounded to qkv's dtype (`_load_scaled`), exactly
                   what scaled_mm.materialize would have stored: e.g. acc 312.0, row 0.004, col 0.0025
                   reads as bf16(0.00312) for x, for its rotation partner and for v alike

Worked example, H = 2, KVH = 1, D = 4, R = 4, one token at position p, no norm:
    qkv row = [q0 (4) | q1 (4) | k0 (4) | v0 (4)]
    each of q0, q1, k0 = [a, b, c, d] -> [a cos0 - c sin0, b cos1 - d sin1, c cos0 + a sin0, d cos1 + b sin1]
    with cos_i, sin_i = cos_sin_cache[p, i], cos_sin_cache[p, 2 + i];
    q = [[q0'], [q1']]; kv_cache[0, s // bs, s % bs, 0] = k0', kv_cache[1, s // bs, s % bs, 0] = v0
    where s = slot_mapping[0] (nothing written when s == -1).
With R < D the features R..D of every head pass through unrotated; with a norm weight each head is
first normalised over all D features.

Rounding follows the unfused kernels step by step, so fp32 results are the same up to the order
of the norm's sum, and bf16/fp16 ones round at the same points: the norm is computed in fp32 as
x * rstd * w and rounded to qkv's dtype (as `rms_norm` stores it), rotated in fp32 and rounded to
qkv's dtype again (as `rotary_embedding` stores it), and K/V are then cast to the cache dtype (as
`write_kv_cache` does).

Work split: grid (T, ceil(H / HPB) + ceil(KVH / HPB)). A program takes HPB heads of one token:
either HPB q heads, or HPB k heads together with the same v heads (they share the token's slot).
Decode at T = 1 is a handful of short programs; a long prefill is T times as many. The grid
depends on shapes only, so a captured CUDA graph replays it as is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.kv_cache_write import to_cache, write_kv_cache_ref
from pagedllm.kernels.quantized_activation import apply_in_scales, check_in_scales
from pagedllm.kernels.rmsnorm import rms_norm_ref
from pagedllm.kernels.rotary import rotary_embedding_ref

__all__ = ["check_prep_inputs", "fused_qkv_prep", "fused_qkv_prep_ref"]


@triton.jit
def _load_scaled(src, offs, mask, rs_ptr, cs, IN_SCALES: tl.constexpr):
    """qkv's values at src + offs, in qkv's dtype. IN_SCALES: qkv is a ScaledOutput's unscaled sums; each value
    times the token's scale (*rs_ptr) and its column's (cs + offs: cs points at src's column of col_scale),
    in fp32 and rounded to qkv's dtype, as kernels/scaled_mm.materialize would have stored it."""
    x = tl.load(src + offs, mask=mask, other=0.0)
    if IN_SCALES:
        x = (x.to(tl.float32) * tl.load(rs_ptr) * tl.load(cs + offs, mask=mask, other=0.0)).to(src.dtype.element_ty)
    return x


@triton.jit
def _norm_rotate(
    src,  # pointer to head 0 of the HPB-head block: (HPB, D) rows of stride D
    cs,  # pointer to src's column of the column scales; read only when IN_SCALES
    rs_ptr,  # pointer to the token's row scale; read only when IN_SCALES
    head_mask,  # (HPB,) bool: heads that exist
    d,  # (DIM_PAD,) feature index
    partner,  # (DIM_PAD,) i + R/2 for i < R/2, i - R/2 for R/2 <= i < R
    first,  # (DIM_PAD,) i < R/2
    is_rot,  # (DIM_PAD,) i < R
    cos,  # (DIM_PAD,) fp32 cos of each feature's pair (0 past R)
    sin,  # (DIM_PAD,) fp32
    w_ptr,  # (D,) norm weight; read only when HAS_NORM
    eps,
    HAS_NORM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    IN_SCALES: tl.constexpr,
):
    # Returns the (HPB, DIM_PAD) fp32 block, normed and rotated, with values already rounded to
    # the source dtype the way the unfused kernels store them in between.
    rows = tl.arange(0, HEADS_PER_BLOCK)[:, None] * HEAD_DIM
    mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
    pmask = head_mask[:, None] & is_rot[None, :]
    x = _load_scaled(src, rows + d[None, :], mask, rs_ptr, cs, IN_SCALES).to(tl.float32)
    xp = _load_scaled(src, rows + partner[None, :], pmask, rs_ptr, cs, IN_SCALES).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + partner, mask=is_rot, other=0.0).to(tl.float32)[None, :]
        x = (x * rstd * w).to(src.dtype.element_ty).to(tl.float32)
        xp = (xp * rstd * wp).to(src.dtype.element_ty).to(tl.float32)
    xc = x * cos[None, :]
    xs = xp * sin[None, :]
    rot = tl.where(first[None, :], xc - xs, xc + xs)
    return tl.where(is_rot[None, :], rot, x).to(src.dtype.element_ty)


@triton.jit
def _rotary_angles(positions_ptr, t, cos_sin_ptr, stride_cos_sin, DIM_PAD: tl.constexpr, ROT_DIM: tl.constexpr):
    """Token t's neox pairing and angles, for `_norm_rotate`: feature index d (DIM_PAD,), its partner
    (i + R/2 or i - R/2), first (i < R/2), is_rot (i < R), and fp32 cos, sin of its pair (0 past R)."""
    HALF: tl.constexpr = ROT_DIM // 2
    d = tl.arange(0, DIM_PAD)
    first = d < HALF
    is_rot = d < ROT_DIM
    partner = tl.where(first, d + HALF, d - HALF)
    freq = tl.where(first, d, d - HALF)  # column of this feature's angle in the cos half
    pos = tl.load(positions_ptr + t).to(tl.int64)
    row = cos_sin_ptr + pos * stride_cos_sin
    cos = tl.load(row + freq, mask=is_rot, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + freq, mask=is_rot, other=0.0).to(tl.float32)
    return d, partner, first, is_rot, cos, sin


@triton.jit(do_not_specialize=["num_slots"])  # per-step token count: no recompiles
def _qkv_prep_kernel(
    qkv_ptr,  # (T, (H + 2 * KVH) * D)
    positions_ptr,  # (T,)
    cos_sin_ptr,  # (max_position, R)
    q_out_ptr,  # (T, H, D) contiguous
    k_cache_ptr,  # (num_blocks, block_size, KVH, D)
    v_cache_ptr,  # (num_blocks, block_size, KVH, D)
    slot_mapping_ptr,  # (S,)
    q_norm_ptr,  # (D,); only when HAS_Q_NORM
    k_norm_ptr,  # (D,); only when HAS_K_NORM
    row_scale_ptr,  # fp32 (T,): a ScaledOutput's per-token scales; only when IN_SCALES
    col_scale_ptr,  # fp32 ((H + 2 * KVH) * D,): its per-column scales; only when IN_SCALES
    num_slots,  # S
    stride_qkv_t,
    stride_cos_sin,
    stride_c_blk,
    stride_c_slot,
    stride_c_h,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    HEADS_PER_BLOCK: tl.constexpr,
    NUM_Q_GROUPS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    IN_SCALES: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    d, partner, first, is_rot, cos, sin = _rotary_angles(positions_ptr, t, cos_sin_ptr, stride_cos_sin, DIM_PAD,
                                                         ROT_DIM)
    h = tl.arange(0, HEADS_PER_BLOCK)
    src_row = qkv_ptr + t * stride_qkv_t
    rs_ptr = row_scale_ptr + t
    if g < NUM_Q_GROUPS:
        h0 = g * HEADS_PER_BLOCK
        head_mask = (h0 + h) < NUM_HEADS
        q = _norm_rotate(src_row + h0 * HEAD_DIM, col_scale_ptr + h0 * HEAD_DIM, rs_ptr, head_mask, d, partner,
                         first, is_rot, cos, sin, q_norm_ptr, eps, HAS_Q_NORM, HEAD_DIM, HEADS_PER_BLOCK, IN_SCALES)
        dst = q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + (h0 + h)[:, None] * HEAD_DIM + d[None, :]
        tl.store(dst, q.to(q_out_ptr.dtype.element_ty), mask=head_mask[:, None] & (d < HEAD_DIM)[None, :])
    else:
        # The slot test comes first: a skipped token (-1, or padding past S) costs no K/V reads.
        slot = tl.load(slot_mapping_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            h0 = (g - NUM_Q_GROUPS) * HEADS_PER_BLOCK
            head_mask = (h0 + h) < NUM_KV_HEADS
            mask = head_mask[:, None] & (d < HEAD_DIM)[None, :]
            k_col = (NUM_HEADS + h0) * HEAD_DIM
            k = _norm_rotate(src_row + k_col, col_scale_ptr + k_col, rs_ptr, head_mask, d, partner, first, is_rot,
                             cos, sin, k_norm_ptr, eps, HAS_K_NORM, HEAD_DIM, HEADS_PER_BLOCK, IN_SCALES)
            dst = ((slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot
                   + (h0 + h)[:, None] * stride_c_h + d[None, :])
            tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr), mask=mask)
            v_col = k_col + NUM_KV_HEADS * HEAD_DIM
            v = _load_scaled(src_row + v_col, h[:, None] * HEAD_DIM + d[None, :], mask, rs_ptr, col_scale_ptr + v_col,
                             IN_SCALES)
            tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr), mask=mask)


def _heads_per_block(num_heads: int, num_kv_heads: int, dim_pad: int) -> int:
    # About 1024 elements per (heads, head_dim) tile: 8 heads of 128, 16 of 64. Qwen3-0.6B
    # (16 q / 8 kv heads of 128) then runs 2 q programs + 1 k/v program per token.
    return min(max(1, 1024 // dim_pad), triton.next_power_of_2(max(num_heads, num_kv_heads)))


def check_prep_inputs(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The shapes `fused_qkv_prep` and the fused decode kernel both read (module doc); ValueError
    naming the first that does not fit."""
    t = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(
            f"qkv must be (num_tokens, ({num_heads} + 2 * {num_kv_heads}) * {head_dim} = {width}), "
            f"got {tuple(qkv.shape)}"
        )
    if positions.shape != (t,):
        raise ValueError(f"positions must be ({t},), got {tuple(positions.shape)}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be (max_position, rot_dim), got {tuple(cos_sin_cache.shape)}")
    rot_dim = cos_sin_cache.shape[1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"cos_sin_cache rot_dim {rot_dim} must be even and <= head_dim {head_dim}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache must be (2, num_blocks, block_size, {num_kv_heads}, {head_dim}), got {tuple(kv_cache.shape)}"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous along head_dim")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and w.shape != (head_dim,):
            raise ValueError(f"{name} must have shape ({head_dim},), got {tuple(w.shape)}")
    check_in_scales(in_scales, t, width, "qkv")


def fused_qkv_prep(
    qkv: torch.Tensor,  # (T, (H + 2 * KVH) * D)
    positions: torch.Tensor,  # (T,) int
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, KVH, D)
    slot_mapping: torch.Tensor,  # (S <= T,) int, -1 = skip
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,  # (D,)
    k_norm_weight: torch.Tensor | None = None,  # (D,)
    eps: float = 1e-6,
    heads_per_block: int | None = None,
    in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # row (T, 1), col ((H + 2 * KVH) * D,) fp32
) -> torch.Tensor:  # q (T, H, D)
    """Norm (optional) + rotate q and k, write k and v to `kv_cache`, return q; see the module doc.
    in_scales: qkv is a ScaledOutput's unscaled sums (PAGEDLLM_FP8_DEFER_SCALES); every value read is scaled
    first, so the results are bitwise those of `scaled_mm.materialize` followed by the call without them.

    No host sync and a grid from shapes only: CUDA-graph capturable. Positions must be below
    cos_sin_cache.shape[0] (not checked, as in `rotary_embedding`). heads_per_block (a power of
    two) overrides the work split, for tuning.
    """
    t = qkv.shape[0]
    check_prep_inputs(qkv, positions, cos_sin_cache, kv_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
                      k_norm_weight, in_scales)
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] > t:
        raise ValueError(f"slot_mapping must be (S,) with S <= num_tokens {t}, got {tuple(slot_mapping.shape)}")
    if heads_per_block is not None and (heads_per_block < 1 or heads_per_block & (heads_per_block - 1)):
        raise ValueError(f"heads_per_block must be a power of two, got {heads_per_block}")
    rot_dim = cos_sin_cache.shape[1]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    dim_pad = triton.next_power_of_2(head_dim)
    hpb = heads_per_block or _heads_per_block(num_heads, num_kv_heads, dim_pad)
    num_q_groups = triton.cdiv(num_heads, hpb)
    grid = (t, num_q_groups + triton.cdiv(num_kv_heads, hpb))
    row_scale, col_scale = in_scales if in_scales is not None else (cache, cache)
    _qkv_prep_kernel[grid](
        qkv,
        positions,
        cache,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        q_norm_weight if q_norm_weight is not None else cache,
        k_norm_weight if k_norm_weight is not None else cache,
        row_scale,
        col_scale,
        slot_mapping.shape[0],
        qkv.stride(0),
        cache.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        ROT_DIM=rot_dim,
        HEADS_PER_BLOCK=hpb,
        NUM_Q_GROUPS=num_q_groups,
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        IN_SCALES=in_scales is not None,
        num_warps=max(1, min(8, hpb * dim_pad // 256)),
    )
    return q


def fused_qkv_prep_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain PyTorch twin of `fused_qkv_prep`, composed of the unfused kernels' references (in_scales: qkv
    materialized first, x * row * col in fp32 rounded to qkv's dtype)."""
    t = qkv.shape[0]
    qkv = apply_in_scales(qkv, in_scales)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    q = rms_norm_ref(q, q_norm_weight, eps) if q_norm_weight is not None else q.clone()
    k = rms_norm_ref(k, k_norm_weight, eps) if k_norm_weight is not None else k.clone()
    rotary_embedding_ref(positions, q, k, head_dim, cos_sin_cache)
    s = slot_mapping.shape[0]
    write_kv_cache_ref(k[:s], v[:s].reshape(s, num_kv_heads, head_dim), kv_cache, slot_mapping)
    return q
