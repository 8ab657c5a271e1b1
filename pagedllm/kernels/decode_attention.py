"""Decode attention with the q/k prep fused in: one launch per layer from the qkv GEMM output.

A decode-only step otherwise runs two kernels per attention layer: `fused_qkv_prep` (q/k norm,
rotary, K/V write) and `paged_attention`. Here each attention program does the prep of its own
token and kv head first:

    program (request r, kv head h[, split s]):
        q rows  = norm + rotate the QUERIES_PER_KV query heads of group h   (from qkv, in registers)
        k', v   = norm + rotate kv head h's key, and its value               (from qkv, in registers)
        write k', v to the cache at slot_mapping[r]                          (one program per (r, h))
        attend to the cached keys 0 .. seq_len - 2 (the context), then to k', v from registers

The new key never makes a round trip through memory, so no program has to wait for another's
write, and the separate prep kernel's launch and the gap after it are gone (their cost per layer,
measured in CUDA graphs: BENCHMARKS.md, "Measurements behind code decisions").

Rounding follows the unfused pair: q and k' are rounded to qkv's dtype after the norm and after
the rotation (`qkv_prep._norm_rotate`), k' and v to the cache dtype before use (as the cache would
hold them). The new key's score and its share of the output are computed in fp32 from those
values instead of in the tile's tl.dot, so bf16 results may differ in the last bits.

Decode-only batches: one token per request, so the token of request r is row r (query_start_loc
is 0, 1, 2, ...). Split-K (`split_k.py`) cuts the context as `paged_attention` does; the last split
also takes the new key, and split 0 writes the cache. CUDA-graph padding rows (seq_len 1, slot -1)
attend only to their own key and write nothing.

Reference: `decode_attention_fused_ref` (the unfused references composed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.envs import environment_variables
from pagedllm.kernels.attention_tile import _LOG2E, _attend_tile, _attend_tile_keys_m, _tile_config
from pagedllm.kernels.kv_cache_write import to_cache
from pagedllm.kernels.paged_attention import paged_attention_ref
from pagedllm.kernels.qkv_prep import _load_scaled, _norm_rotate, _rotary_angles, check_prep_inputs, fused_qkv_prep_ref
from pagedllm.kernels.split_k import (
    FEW_DECODE_PROGRAMS,
    alloc_partials,
    choose_num_splits,
    merge_splits,
    split_key_range,
    store_partials,
)

__all__ = ["DECODE_VARIANTS", "decode_attention_fused", "decode_attention_fused_ref"]

# The decode loop's formulations (`_decode_fused_kernel` VARIANT):
#   0  rows = the GQA group's query heads (BLOCK_M, padded to 16), 16-bit dots (an fp8 cache widened to fp16)
#   3  keys as the MMA's M (attention_tile._attend_tile_keys_m): with an fp8 cache, QK in e4m3 on Hopper's
#      wgmma (q rounded to e4m3 per row, its scale folded into the score scale), PV in fp16; the softmax
#      denominators summed over the keys once, after the loop
# (1, an e4m3 QK with rows as M, measured no faster than 0 on the H200: BENCHMARKS.md, issue 19, h43; 2, 3
# summing the denominators every tile: W1 with an fp8 cache 2.1% slower than 3, twentieth session.)
DECODE_VARIANTS = (0, 3)
# An fp8 cache's loop (PAGEDLLM_FP8_KV_DOTS, on by default; =0: variant 0) and its tiles (BLOCK_M, TILE_N,
# warps, stages): of the H200 sweep, within 2% of the fastest at 256 requests x 600-1000 keys and the fastest
# at 64 x 900-1500 (187.9 / 75.2 us; 64-key tiles 184.3 / 93.2), and W1's faster (13,922 vs 13,822 tok/s):
# BENCHMARKS.md, issue 19, twentieth session.
FP8_KV_DOTS = environment_variables["PAGEDLLM_FP8_KV_DOTS"]()
FP8_KV_VARIANT = 3
FP8_KV_CONFIG = (16, 128, 4, 3)


def _fp8_kv_override(spec: str) -> tuple[int, tuple[int, int, int, int]] | None:
    """PAGEDLLM_FP8_KV_DECODE "VARIANT,BLOCK_M,TILE_N,warps,stages" (A/B runs), e.g. "3,16,64,4,3"."""
    if not spec:
        return None
    try:
        fields = tuple(int(x) for x in spec.split(","))
        if len(fields) != 5:
            raise ValueError
        return fields[0], fields[1:]  # type: ignore[return-value]
    except ValueError:
        raise ValueError(f"PAGEDLLM_FP8_KV_DECODE={spec!r}: expected VARIANT,BLOCK_M,TILE_N,warps,stages, "
                         "e.g. 3,16,64,4,3") from None


_FP8_KV_OVERRIDE = _fp8_kv_override(environment_variables["PAGEDLLM_FP8_KV_DECODE"]())
if _FP8_KV_OVERRIDE is not None:
    FP8_KV_VARIANT, FP8_KV_CONFIG = _FP8_KV_OVERRIDE


@triton.jit(do_not_specialize=["num_reqs", "num_slots", "num_splits", "stride_bt"])
def _decode_fused_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim); unused when USE_SPLIT
    part_acc_ptr,  # fp32 (num_tokens, num_heads, num_splits, HEAD_DIM_PAD); only when USE_SPLIT
    part_m_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    part_l_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    qkv_ptr,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    positions_ptr,  # (num_tokens,)
    cos_sin_ptr,  # (max_position, ROT_DIM): [cos | sin]
    q_norm_ptr,  # (head_dim,); only when HAS_Q_NORM
    k_norm_ptr,  # (head_dim,); only when HAS_K_NORM
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same shape and strides as k_cache
    block_table_ptr,  # int32 (>= num_reqs, max_blocks_per_req)
    seq_lens_ptr,  # int32 (>= num_reqs,)
    slot_mapping_ptr,  # int64 (num_slots,): rows >= num_slots are not written
    order_ptr,  # int32 (num_reqs,): decode_order; only read when ORDERED
    row_scale_ptr,  # fp32 (num_tokens,): a ScaledOutput's per-token scales; only when IN_SCALES
    col_scale_ptr,  # fp32 ((num_heads + 2 * num_kv_heads) * head_dim,): its per-column scales; only when IN_SCALES
    num_reqs,
    num_slots,
    num_splits,
    scale_log2,
    eps,
    stride_qkv_t,
    stride_cos_sin,
    stride_o_t,
    stride_o_h,
    stride_c_blk,
    stride_c_slot,
    stride_c_h,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    ROT_DIM: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr,
    ORDERED: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    VARIANT: tl.constexpr = 0,  # DECODE_VARIANTS: 0 query rows as the MMA's M, 3 keys
    IN_SCALES: tl.constexpr = False,  # qkv is a ScaledOutput's unscaled sums (qkv_prep._load_scaled)
):
    if ORDERED:
        seq_idx = tl.load(order_ptr + tl.program_id(0))
    else:
        seq_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq_idx.to(tl.int64)  # the request's one token
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - 1  # cached keys; the new key sits at position context_len

    d, partner, first, is_rot, cos, sin = _rotary_angles(positions_ptr, row, cos_sin_ptr, stride_cos_sin,
                                                         HEAD_DIM_PAD, ROT_DIM)

    # q rows of the tile: the group's query heads, padded to BLOCK_M rows.
    offs_m = tl.arange(0, BLOCK_M)
    row_valid = offs_m < QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m
    src = qkv_ptr + row * stride_qkv_t
    rs_ptr = row_scale_ptr + row
    q_col = kv_head * QUERIES_PER_KV * HEAD_DIM
    q = _norm_rotate(src + q_col, col_scale_ptr + q_col, rs_ptr, row_valid, d, partner, first, is_rot, cos, sin,
                     q_norm_ptr, eps, HAS_Q_NORM, HEAD_DIM, BLOCK_M, IN_SCALES)  # (BLOCK_M, HEAD_DIM_PAD), qkv dtype
    # The new key and value, as the cache holds them: (1, HEAD_DIM_PAD).
    one = tl.full([1], 1, tl.int1)
    d_mask = (d < HEAD_DIM)[None, :]
    k_col = (NUM_HEADS + kv_head) * HEAD_DIM
    k_new = to_cache(_norm_rotate(src + k_col, col_scale_ptr + k_col, rs_ptr, one, d, partner, first, is_rot, cos,
                                  sin, k_norm_ptr, eps, HAS_K_NORM, HEAD_DIM, 1, IN_SCALES), k_cache_ptr)
    v_col = k_col + NUM_KV_HEADS * HEAD_DIM
    v_new = to_cache(_load_scaled(src + v_col, d[None, :], d_mask, rs_ptr, col_scale_ptr + v_col, IN_SCALES),
                     v_cache_ptr)
    if split == 0:
        slot = tl.load(slot_mapping_ptr + row, mask=row < num_slots, other=-1).to(tl.int64)
        if slot >= 0:
            dst = (slot // BLOCK_SIZE) * stride_c_blk + (slot % BLOCK_SIZE) * stride_c_slot + kv_head * stride_c_h
            tl.store(k_cache_ptr + dst + d[None, :], k_new, mask=d_mask)
            tl.store(v_cache_ptr + dst + d[None, :], v_new, mask=d_mask)

    # The context, split or not; every cached key is visible to the token (q_pos = context_len).
    kv_lo, kv_hi = split_key_range(context_len, split, num_splits, TILE_N, USE_SPLIT)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_h
    q_pos = tl.zeros([BLOCK_M], tl.int32) + context_len
    if VARIANT == 3:
        # An fp8 cache: q quantized per row to e4m3 (q ~= q8 * q_scale) for the e4m3 QK dot, the row scales
        # folded into the score scale; a 16-bit cache keeps q.
        if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
            qf = q.to(tl.float32)
            q_scale = tl.maximum(tl.max(tl.abs(qf), 1) / 448.0, 1e-30)  # (BLOCK_M,)
            q8 = tl.minimum(tl.maximum(qf / q_scale[:, None], -448.0), 448.0).to(tl.float8e4nv)
            col_scale = (scale_log2 * q_scale)[None, :]
        else:
            q8 = q
            col_scale = tl.zeros([1, BLOCK_M], tl.float32) + scale_log2
        acc_t = tl.zeros([HEAD_DIM_PAD, BLOCK_M], tl.float32)
        l_t = tl.zeros([TILE_N, BLOCK_M], tl.float32)  # per key slot; summed once after the loop
        qt = tl.trans(q8)
        for start_n in range(kv_lo, kv_hi, TILE_N):
            m_i, l_t, acc_t = _attend_tile_keys_m(
                qt, m_i, l_t, acc_t, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, col_scale,
                stride_c_blk, stride_c_slot, HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, DOT_PRECISION,
            )
        l_i = tl.sum(l_t, 0)
        acc = tl.trans(acc_t)
    else:
        for start_n in range(kv_lo, kv_hi, TILE_N):
            m_i, l_i, acc = _attend_tile(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, q_pos,
                stride_c_blk, stride_c_slot, scale_log2, 0, 0.0,  # no window, no soft-cap (the backend's rule)
                HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, DOT_PRECISION, True,
            )

    # The new key: one more online-softmax update, from registers (the last split takes it).
    if split == num_splits - 1:
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2  # (BLOCK_M,)
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.math.exp2(m_i - m_new)
        p_new = tl.math.exp2(s_new - m_new)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)
        m_i = m_new

    if USE_SPLIT:
        part = (row * NUM_HEADS + head) * num_splits + split  # (BLOCK_M,)
        store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, row_valid, d, HEAD_DIM_PAD)
    else:
        out = acc / l_i[:, None]  # l >= 1 on valid rows: the new key's term is 2^0 at the max
        tl.store(out_ptr + row * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask)


def decode_attention_fused(
    qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
    positions: torch.Tensor,  # (num_tokens,) int
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    md: AttentionMetadata,  # decode-only: max_query_len 1
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,  # (head_dim,)
    k_norm_weight: torch.Tensor | None = None,  # (head_dim,)
    eps: float = 1e-6,
    *,
    num_splits: int | None = None,
    variant: int | None = None,
    config: tuple[int, int, int, int] | None = None,
    in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # row (num_tokens, 1), col (qkv width,) fp32
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """`fused_qkv_prep` followed by `paged_attention`, for a decode-only batch, in one launch (see
    the module doc). Writes this step's K/V to the cache like the pair does. Rows past
    md.num_actual_tokens (CUDA-graph padding) come back as zeros unless a request claims them.
    No host sync, a grid from host ints only: CUDA-graph capturable.
    variant (DECODE_VARIANTS) / config (BLOCK_M, TILE_N, warps, stages): None = the defaults (an fp8 cache:
    FP8_KV_VARIANT with FP8_KV_CONFIG when PAGEDLLM_FP8_KV_DOTS=1).
    in_scales: qkv is a ScaledOutput's unscaled sums (PAGEDLLM_FP8_DEFER_SCALES), scaled as read: bitwise the
    results of `scaled_mm.materialize` followed by the call without them."""
    t = qkv.shape[0]
    check_prep_inputs(qkv, positions, cos_sin_cache, kv_cache, num_heads, num_kv_heads, head_dim, q_norm_weight,
                      k_norm_weight, in_scales)
    if md.max_query_len != 1 or md.num_actual_tokens != md.num_reqs:
        raise ValueError(
            f"decode_attention_fused takes decode-only batches (one token per request), got max_query_len "
            f"{md.max_query_len} and {md.num_actual_tokens} tokens for {md.num_reqs} requests"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    n = md.num_reqs
    if t > n:
        out[n:].zero_()
    if n == 0:
        return out
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(1) == 1 else cos_sin_cache.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits is None:
        num_splits = choose_num_splits(n, num_kv_heads, 1, md.max_seq_len)
    use_split = num_splits > 1
    # An fp8 cache keeps the 128-key, 3-stage tiles: its 64-key tiles were the slower ones (H200, 64 requests
    # x 900-1500 keys: 112 vs 93 us, BENCHMARKS.md issue 19).
    few = not use_split and n * num_kv_heads <= FEW_DECODE_PROGRAMS and kv_cache.element_size() > 1
    block_m, _, tile_n, num_warps, num_stages = _tile_config(queries_per_kv, head_dim_pad, True, few_programs=few)
    fp8_cache = kv_cache.dtype == torch.float8_e4m3fn
    if variant is None:
        variant = FP8_KV_VARIANT if fp8_cache and FP8_KV_DOTS and head_dim_pad <= 128 else 0
        if variant != 0 and config is None:
            config = FP8_KV_CONFIG
    if config is not None:  # (BLOCK_M, TILE_N, num_warps, num_stages): the sweeps' override
        block_m, tile_n, num_warps, num_stages = config
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"decode attention variant must be one of {DECODE_VARIANTS}, got {variant}")
    if use_split:
        part_acc, part_m, part_l = alloc_partials(t, num_heads, num_splits, head_dim_pad, qkv.device)
    else:
        part_acc = part_m = part_l = out  # never touched: USE_SPLIT is a compile-time False
    order = md.decode_order
    slots = md.slot_mapping[:n]
    row_scale, col_scale = in_scales if in_scales is not None else (cache, cache)
    _decode_fused_kernel[(n, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_m,
        part_l,
        qkv,
        positions,
        cache,
        q_norm_weight if q_norm_weight is not None else cache,
        k_norm_weight if k_norm_weight is not None else cache,
        k_cache,
        v_cache,
        md.block_table,
        md.seq_lens,
        slots,
        order if order is not None else md.seq_lens,
        row_scale,
        col_scale,
        n,
        slots.shape[0],
        num_splits,
        scale * _LOG2E,
        eps,
        qkv.stride(0),
        cache.stride(0),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        md.block_table.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        ROT_DIM=cos_sin_cache.shape[1],
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        BLOCK_SIZE=kv_cache.shape[2],
        HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None,
        ORDERED=order is not None,
        USE_SPLIT=use_split,
        DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        VARIANT=variant,
        IN_SCALES=in_scales is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if use_split:
        merge_splits(out, part_acc, part_m, part_l, md)
    return out


def decode_attention_fused_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The unfused pair's references: prep (norm, rotary, K/V write; in_scales: qkv materialized first), then
    attention over the cache."""
    n = md.num_actual_tokens
    q = fused_qkv_prep_ref(qkv, positions, cos_sin_cache, kv_cache, md.slot_mapping[:n], num_heads, num_kv_heads,
                           head_dim, q_norm_weight, k_norm_weight, eps, in_scales)
    return paged_attention_ref(q, kv_cache, md, scale)
