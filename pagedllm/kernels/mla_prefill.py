"""MLA prefill: multi-head causal attention of prefill chunks over expanded keys/values (DeepSeek V2/V3).

Decode steps attend in latent space (kernels/mla_decode.py), where every head shares one 576-wide
key. For a prefill chunk that costs 576 + 512 MACs per (query, key, head) - the unified kernel even
pads both to 1024. Expanding the cached latents through kv_b_proj instead (attention/mla_prefill.py)
gives per-head keys [k_nope (NOPE) | k_pe (ROPE, shared by all heads)] and values (DV):
DeepSeek's 128 + 64 and 128, about 3.4x fewer FLOPs, and ordinary flash attention over them.

One launch covers one *pass*: a list of entries, each (request, a contiguous range of its keys in
the pass's expanded buffers). Per entry (int32 row of `entries`):

    q_start, q_len    the request's query rows in the step's token batch
    k_start, k_len    its keys' rows in this pass's k_nope / k_pe / v
    delta             causal offset: query i sees key j of the range iff j <= i + delta
                      (delta = context_len - range start; the range may start inside the chunk)
    first             1 when the range starts at key 0: write the result; 0: merge it with the one
                      already in out / lse (a long context cut over several passes)

Work split: a program owns (BLOCK_M query rows of one entry) x (one head); `tiles` lists (entry,
first row) per program, built on the host. Key tiles fully visible to the tile's first row run
unmasked, the diagonal and ragged end masked (as kernels/paged_attention.py). Scores in base 2;
lse (T, H) fp32 is log2 of the softmax denominator of the base-2 scores, kept for the merge.

Reference: `mla_prefill_ref` in attention/mla_prefill.py (plain torch, the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.attention_tile import _LOG2E

__all__ = ["PREFILL_TILE", "mla_prefill_attention"]

# (BLOCK_M, BLOCK_N, num_warps, num_stages): not yet tuned on the GPU (scripts/gpu_mla_prefill_check.py sweeps).
PREFILL_TILE = (64, 64, 4, 2)


@triton.jit
def _attend(qn, qp, m_i, l_i, acc, kn_ptr, kp_ptr, v_ptr, k_row0, start_n, k_len, q_idx, delta,
            stride_kn_t, stride_kp_t, stride_v_t, scale_log2,
            NOPE: tl.constexpr, ROPE: tl.constexpr, DV: tl.constexpr, NOPE_PAD: tl.constexpr,
            ROPE_PAD: tl.constexpr, DV_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
            DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step over keys start_n .. start_n + BLOCK_N - 1 of the entry's range.
    kn_ptr / v_ptr already point at this head; MASKED=False promises all keys valid and visible."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_a = tl.arange(0, NOPE_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    offs_v = tl.arange(0, DV_PAD)
    rows = (k_row0 + offs_n).to(tl.int64)
    n_ok = offs_n < k_len
    if MASKED:
        kn = tl.load(kn_ptr + rows[None, :] * stride_kn_t + offs_a[:, None],
                     mask=n_ok[None, :] & (offs_a[:, None] < NOPE), other=0.0)  # (NOPE_PAD, BLOCK_N)
        kp = tl.load(kp_ptr + rows[None, :] * stride_kp_t + offs_p[:, None],
                     mask=n_ok[None, :] & (offs_p[:, None] < ROPE), other=0.0)
    elif NOPE == NOPE_PAD and ROPE == ROPE_PAD:  # DeepSeek's 128 + 64: no masks at all
        kn = tl.load(kn_ptr + rows[None, :] * stride_kn_t + offs_a[:, None])
        kp = tl.load(kp_ptr + rows[None, :] * stride_kp_t + offs_p[:, None])
    else:
        kn = tl.load(kn_ptr + rows[None, :] * stride_kn_t + offs_a[:, None], mask=offs_a[:, None] < NOPE, other=0.0)
        kp = tl.load(kp_ptr + rows[None, :] * stride_kp_t + offs_p[:, None], mask=offs_p[:, None] < ROPE, other=0.0)
    s = tl.dot(qn, kn, input_precision=DOT_PRECISION)
    s += tl.dot(qp, kp, input_precision=DOT_PRECISION)
    s = s * scale_log2  # (BLOCK_M, BLOCK_N)
    if MASKED:
        visible = n_ok[None, :] & (offs_n[None, :] <= q_idx[:, None] + delta)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet: exp2 -> 0, not NaN
        v = tl.load(v_ptr + rows[:, None] * stride_v_t + offs_v[None, :],
                    mask=n_ok[:, None] & (offs_v[None, :] < DV), other=0.0)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
        if DV == DV_PAD:
            v = tl.load(v_ptr + rows[:, None] * stride_v_t + offs_v[None, :])
        else:
            v = tl.load(v_ptr + rows[:, None] * stride_v_t + offs_v[None, :], mask=offs_v[None, :] < DV, other=0.0)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_heads"])
def _mla_prefill_kernel(
    out_ptr,  # (T, H, DV)
    lse_ptr,  # fp32 (T, H)
    qn_ptr,  # (T, H, NOPE), any row / head strides
    qp_ptr,  # (T, H, ROPE)
    kn_ptr,  # (K, H, NOPE)
    kp_ptr,  # (K, ROPE): shared by every head
    v_ptr,  # (K, H, DV)
    tiles_ptr,  # int32 (num_tiles, 2): entry, first query row of the tile
    entries_ptr,  # int32 (num_entries, 6): see the module docstring
    num_heads,
    scale_log2,
    stride_o_t, stride_o_h,
    stride_qn_t, stride_qn_h,
    stride_qp_t, stride_qp_h,
    stride_kn_t, stride_kn_h,
    stride_kp_t,
    stride_v_t, stride_v_h,
    NOPE: tl.constexpr, ROPE: tl.constexpr, DV: tl.constexpr,
    NOPE_PAD: tl.constexpr, ROPE_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    entry = tl.load(tiles_ptr + tile * 2)
    q_off = tl.load(tiles_ptr + tile * 2 + 1)
    e = entries_ptr + entry * 6
    q_start = tl.load(e)
    q_len = tl.load(e + 1)
    k_row0 = tl.load(e + 2)
    k_len = tl.load(e + 3)
    delta = tl.load(e + 4)
    first = tl.load(e + 5)

    q_idx = q_off + tl.arange(0, BLOCK_M)  # query index within the request's chunk
    m_ok = q_idx < q_len
    q_rows = (q_start + q_idx).to(tl.int64)
    offs_a = tl.arange(0, NOPE_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    offs_v = tl.arange(0, DV_PAD)
    qn = tl.load(qn_ptr + q_rows[:, None] * stride_qn_t + head * stride_qn_h + offs_a[None, :],
                 mask=m_ok[:, None] & (offs_a[None, :] < NOPE), other=0.0)
    qp = tl.load(qp_ptr + q_rows[:, None] * stride_qp_t + head * stride_qp_h + offs_p[None, :],
                 mask=m_ok[:, None] & (offs_p[None, :] < ROPE), other=0.0)

    # Keys of the range visible to some row of the tile: j <= q_off + BLOCK_M - 1 + delta; to all: j <= q_off + delta.
    kv_end = tl.minimum(k_len, q_off + BLOCK_M + delta)
    kv_full = tl.maximum(tl.minimum(kv_end, q_off + delta + 1), 0) // BLOCK_N * BLOCK_N
    kn_head = kn_ptr + head.to(tl.int64) * stride_kn_h
    v_head = v_ptr + head.to(tl.int64) * stride_v_h
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    for start_n in range(0, kv_full, BLOCK_N):
        m_i, l_i, acc = _attend(qn, qp, m_i, l_i, acc, kn_head, kp_ptr, v_head, k_row0, start_n, k_len, q_idx,
                                delta, stride_kn_t, stride_kp_t, stride_v_t, scale_log2,
                                NOPE, ROPE, DV, NOPE_PAD, ROPE_PAD, DV_PAD, BLOCK_N, DOT_PRECISION, False)
    for start_n in range(kv_full, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend(qn, qp, m_i, l_i, acc, kn_head, kp_ptr, v_head, k_row0, start_n, k_len, q_idx,
                                delta, stride_kn_t, stride_kp_t, stride_v_t, scale_log2,
                                NOPE, ROPE, DV, NOPE_PAD, ROPE_PAD, DV_PAD, BLOCK_N, DOT_PRECISION, True)

    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    o_ptrs = out_ptr + q_rows[:, None] * stride_o_t + head * stride_o_h + offs_v[None, :]
    lse_ptrs = lse_ptr + q_rows * num_heads + head
    o_mask = m_ok[:, None] & (offs_v[None, :] < DV)
    if first == 0:
        # Merge with the earlier ranges' result. Their first range started at key 0, which every
        # query sees, so lse_prev is finite; rows that saw nothing here get weight exp2(-inf) = 0.
        lse_prev = tl.load(lse_ptrs, mask=m_ok, other=0.0)
        o_prev = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
        top = tl.maximum(lse_prev, lse)
        w_prev = tl.math.exp2(lse_prev - top)
        w_cur = tl.math.exp2(lse - top)
        o = (o_prev * w_prev[:, None] + o * w_cur[:, None]) / (w_prev + w_cur)[:, None]
        lse = top + tl.math.log2(w_prev + w_cur)
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptrs, lse, mask=m_ok)


def mla_prefill_attention(
    out: torch.Tensor,  # (T, H, DV), written at the entries' query rows
    lse: torch.Tensor,  # fp32 (T, H), contiguous
    q_nope: torch.Tensor,  # (T, H, NOPE)
    q_pe: torch.Tensor,  # (T, H, ROPE), rotated
    k_nope: torch.Tensor,  # (K, H, NOPE): this pass's expanded keys
    k_pe: torch.Tensor,  # (K, ROPE), rotated, shared by every head
    v: torch.Tensor,  # (K, H, DV)
    entries: torch.Tensor,  # int32 (num_entries, 6), on the device
    tiles: torch.Tensor,  # int32 (num_tiles, 2), on the device, built for block_m (attention/mla_prefill.py)
    scale: float,
    tile: tuple[int, int, int, int] | None = None,  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
) -> None:
    """One pass of prefill attention (see the module docstring): results land in out / lse."""
    block_m, block_n, num_warps, num_stages = tile or PREFILL_TILE
    num_tiles = tiles.shape[0]
    h = q_nope.shape[1]
    if num_tiles == 0:
        return
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("k_nope", k_nope), ("k_pe", k_pe), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"mla_prefill_attention: {name} must be contiguous in its last dimension")
    nope, rope, dv = q_nope.shape[2], q_pe.shape[2], v.shape[2]
    _mla_prefill_kernel[(num_tiles, h)](
        out, lse, q_nope, q_pe, k_nope, k_pe, v, tiles, entries, h, scale * _LOG2E,
        out.stride(0), out.stride(1), q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        NOPE=nope, ROPE=rope, DV=dv, NOPE_PAD=max(16, triton.next_power_of_2(nope)),
        ROPE_PAD=max(16, triton.next_power_of_2(rope)), DV_PAD=max(16, triton.next_power_of_2(dv)),
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION="ieee" if q_nope.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
