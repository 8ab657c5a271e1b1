"""Unified paged attention for a flat batch of prefill chunks and decodes (one Triton kernel).

Work split. A program owns (a tile of BLOCK_Q query tokens of one request) x (one kv head) and
computes all QUERIES_PER_KV query heads of that kv head at once: the tile's rows are
(token, head-in-group) pairs flattened into BLOCK_M = BLOCK_Q * QUERIES_PER_KV (+ padding) rows, so
every K/V tile read from the cache feeds the whole GQA group. Example, 4 query heads per kv head,
BLOCK_M 16: BLOCK_Q = 4 tokens, row r = (token r // 4, head kv_head * 4 + r % 4).

Keys. The program walks the request's keys 0..kv_end in tiles of TILE_N positions; position p
lives at kv_cache[:, block_table[req, p // block_size], p % block_size]. Because each key looks up
its own block, TILE_N is independent of the cache's block_size (any block size works, even 4).
Softmax is online (running max m and sum l, in fp32 and base 2); query token i of a request sits at
absolute position seq_len - query_len + i and sees keys 0..that position.

Finding the request. Query tiles are numbered request by request; request r's first tile is
query_start_loc[r] // BLOCK_Q + r (an upper bound of the tiles before it), so the grid
num_tokens // BLOCK_Q + num_reqs is known on the host and each program binary-searches its
request. Numbers left over by the bound land past their request's last token and exit at once.
Decode-only batches skip the search: program r is request r, or request decode_order[r] when the
metadata gives that order (longest context first, so the longest programs start in the first wave
instead of trailing in the last; measured gain in BENCHMARKS.md, "Measurements behind code decisions").

Split-K (flash decoding). With few requests and long contexts, (requests x kv heads) programs
cannot fill the GPU, so the keys of every tile are cut into num_splits chunks handled by separate
programs, which write unnormalised partial results (acc, m, l); a second small kernel merges them
(kernels/split_k.py: the partition count and the merge).

Host syncs. The grid depends only on num_tokens, num_reqs, max_query_len and max_seq_len, all
Python ints in AttentionMetadata, so a decode-only launch is CUDA-graph capturable. When
capturing, give the metadata the static maxima the graph must cover (max_seq_len = max_model_len):
programs past a request's real length exit early.

Reference: `paged_attention_ref` below (the plain PyTorch path of `pagedllm.attention.torch_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention import torch_ref
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.attention_tile import _LOG2E, _attend_tile, _tile_config
from pagedllm.kernels.split_k import (
    FEW_DECODE_PROGRAMS,
    alloc_partials,
    choose_num_splits,
    merge_splits,
    split_key_range,
    store_partials,
)

__all__ = ["paged_attention", "paged_attention_ref"]


@triton.jit
def _find_seq_idx(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q: tl.constexpr):
    # Largest r in [0, num_reqs) with query_start_loc[r] // BLOCK_Q + r <= q_block_global.
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        go_right = first_block <= q_block_global
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(go_right, hi, mid)
    return lo - 1


# Per-step values (request count, split count, the block table's width) are not specialised on:
# a new value must never trigger a recompilation in the middle of a run.
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt"])
def _paged_attention_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim); unused when USE_SPLIT
    part_acc_ptr,  # fp32 (num_tokens, num_heads, num_splits, HEAD_DIM_PAD); only when USE_SPLIT
    part_m_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    part_l_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    q_ptr,  # (num_tokens, num_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # same shape and strides as k_cache
    block_table_ptr,  # int32 (>= num_reqs, max_blocks_per_req)
    seq_lens_ptr,  # int32 (>= num_reqs,)
    query_start_loc_ptr,  # int32 (>= num_reqs + 1,)
    order_ptr,  # int32 (num_reqs,): decode_order; only read when ORDERED
    num_reqs,
    num_heads,
    num_splits,
    scale_log2,  # softmax scale * log2(e): scores live in base 2
    window,  # sliding window (keys > q_pos - window visible); read only when USE_WINDOW
    soft_cap_log2,  # attention logit soft-cap * log2(e); read only when USE_SOFTCAP
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_blk,
    stride_c_slot,
    stride_c_h,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    ORDERED: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr = False,
    USE_SOFTCAP: tl.constexpr = False,
):
    q_block_global = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        if ORDERED:
            seq_idx = tl.load(order_ptr + q_block_global)
        else:
            seq_idx = q_block_global
        q_block_local = q_block_global * 0
    else:
        seq_idx = _find_seq_idx(query_start_loc_ptr, q_block_global, num_reqs, BLOCK_Q)
        q_block_local = q_block_global - (tl.load(query_start_loc_ptr + seq_idx) // BLOCK_Q + seq_idx)

    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len

    # Rows of the tile: (token within the request, query head).
    offs_m = tl.arange(0, BLOCK_M)
    tok = q_block_local * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m // QUERIES_PER_KV < BLOCK_Q) & (tok < q_len)
    q_pos = context_len + tok  # absolute position: sees keys 0..q_pos
    q_row = (q_start + tok).to(tl.int64)

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + q_row[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )

    # Keys visible to any row of this tile: 0 .. position of its last token.
    kv_end = tl.minimum(seq_len, context_len + (q_block_local + 1) * BLOCK_Q)
    kv_lo, kv_hi = split_key_range(kv_end, split, num_splits, TILE_N, USE_SPLIT)
    if USE_WINDOW:
        # Keys older than the tile's first query's window are never read (whole tiles skipped).
        win_lo = tl.maximum(context_len + q_block_local * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N
        kv_lo = tl.maximum(kv_lo, win_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_table_ptr + seq_idx.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_c_h

    # Prefill tiles: interior key tiles first. Every key of [kv_lo, kv_full) is valid and visible
    # to every row (it is at or before the tile's first query position), so they need no masks;
    # the rest (the diagonal and the ragged end) go through the masked loop. Example, TILE_N 32, a
    # 64-token query tile at positions 100..163: keys 0..95 unmasked in 3 tiles, 96..163 masked in
    # 3. Prefill-heavy batches gain from the split; decode-only batches keep the one masked loop,
    # where the split made them slower (both measured: BENCHMARKS.md).
    if DECODE_ONLY or USE_WINDOW:  # with a window every tile is masked (its lower edge moves per row)
        kv_full = kv_lo
    else:
        first_q_pos = context_len + q_block_local * BLOCK_Q
        kv_full = kv_lo + (tl.maximum(tl.minimum(kv_hi, first_q_pos + 1) - kv_lo, 0) // TILE_N) * TILE_N
    for start_n in range(kv_lo, kv_full, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, q_pos,
            stride_c_blk, stride_c_slot, scale_log2, window, soft_cap_log2,
            HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, DOT_PRECISION, False, USE_WINDOW, USE_SOFTCAP,
        )
    for start_n in range(kv_full, kv_hi, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, q_pos,
            stride_c_blk, stride_c_slot, scale_log2, window, soft_cap_log2,
            HEAD_DIM, HEAD_DIM_PAD, TILE_N, BLOCK_SIZE, DOT_PRECISION, True, USE_WINDOW, USE_SOFTCAP,
        )

    if USE_SPLIT:
        part = (q_row * num_heads + head) * num_splits + split  # (BLOCK_M,)
        store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, row_valid, offs_d, HEAD_DIM_PAD)
    else:
        # Every valid row sees at least key 0, so l > 0 there; the guard only covers padding rows.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + q_row[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_mask[None, :],
        )


def paged_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    md: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
    """Attend every query token to its request's cached keys 0..its position.

    sliding_window W: a query at position p sees keys p - W + 1 .. p only (transformers' rule);
    logits_soft_cap c: scores s -> c * tanh(s / c) before the softmax (Gemma 2).

    This step's K/V must already be in the cache (`write_kv_cache`). Rows past
    md.num_actual_tokens (CUDA-graph padding) come back as zeros, as in the reference, unless a
    (dummy) request in md claims them: rows are attended exactly where query_start_loc says.
    num_splits: None picks with `choose_num_splits`; 1 disables split-K; k > 1 forces k partitions.
    """
    if query.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"expected query (tokens, heads, head_dim) and kv_cache (2, blocks, block_size, kv_heads, head_dim), "
            f"got {tuple(query.shape)} and {tuple(kv_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads {num_heads} x {head_dim} do not fit kv_cache heads {num_kv_heads} x {cache_head_dim}"
        )
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    n = md.num_actual_tokens
    out = torch.empty_like(query)
    if num_tokens > n:
        out[n:].zero_()
    if num_tokens == 0 or md.num_reqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous along head_dim")

    queries_per_kv = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    decode_only = md.max_query_len == 1
    if num_splits is None:
        num_splits = choose_num_splits(md.num_reqs, num_kv_heads, md.max_query_len, md.max_seq_len)
    use_split = num_splits > 1
    # fp8 caches keep 128-key tiles (decode_attention.py says why).
    few = (decode_only and not use_split and md.num_reqs * num_kv_heads <= FEW_DECODE_PROGRAMS
           and kv_cache.element_size() > 1)
    block_m, block_q, tile_n, num_warps, num_stages = _tile_config(queries_per_kv, head_dim_pad, decode_only,
                                                                   few_programs=few)
    order = md.decode_order
    ordered = decode_only and order is not None
    # Upper bound of query tiles; see the module docstring.
    num_q_blocks = md.num_reqs if decode_only else num_tokens // block_q + md.num_reqs

    if use_split:
        part_acc, part_m, part_l = alloc_partials(num_tokens, num_heads, num_splits, head_dim_pad, query.device)
    else:
        part_acc = part_m = part_l = out  # never touched: USE_SPLIT is a compile-time False
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_m,
        part_l,
        query,
        k_cache,
        v_cache,
        md.block_table,
        md.seq_lens,
        md.query_start_loc,
        order if ordered else md.seq_lens,
        md.num_reqs,
        num_heads,
        num_splits,
        scale * _LOG2E,
        sliding_window or 0,
        (logits_soft_cap or 0.0) * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        md.block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        BLOCK_SIZE=block_size,
        DECODE_ONLY=decode_only,
        ORDERED=ordered,
        USE_SPLIT=use_split,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        USE_WINDOW=bool(sliding_window),
        USE_SOFTCAP=bool(logits_soft_cap),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if use_split:
        merge_splits(out, part_acc, part_m, part_l, md)
    return out


def paged_attention_ref(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), either layout
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """`torch_ref.paged_attention` without its cache write, for holding the kernel to it.

    The reference first writes key/value through slot_mapping; handing it the very rows already
    stored at those slots makes that write a no-op (slots of -1 are skipped either way).
    """
    n = md.num_actual_tokens
    slots = md.slot_mapping[:n].clamp(min=0)
    key, value = torch_ref.slot_rows(kv_cache[0], slots), torch_ref.slot_rows(kv_cache[1], slots)
    return torch_ref.paged_attention(query, key, value, kv_cache, md, scale,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
