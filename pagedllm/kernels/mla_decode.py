"""MLA decode: a decode-only batch's attention over the latent cache (DeepSeek V2/V3), one Triton kernel.

The cache holds one latent row per token, [c_kv (R) | k_pe (P)] (attention/mla.py); queries come
folded into latent space, [q_lat (R) | q_pe (P)] per head. Per head h and key j:

    score[h, j] = (q_lat[h] . c_kv[j] + q_pe[h] . k_pe[j]) * scale,   out[h] = softmax(score[h]) @ c_kv

Work split. A program owns (one request) x (BLOCK_H query heads) x (one key partition): every head
shares the one latent row per key, so each latent tile is read from the cache once and serves both
products (scores and values) of all BLOCK_H heads. The unified kernel (kernels/paged_attention.py)
treats the latent as a head of width R + P padded to a power of two (576 -> 1024 for DeepSeek) and
loads it twice, as K and as V; here c_kv (512) and k_pe (64) are two power-of-two loads of one row.
DeepSeek-V2-Lite: 16 heads -> one head block per request; V3: 128 heads -> 8.

Split-K as the unified kernel (kernels/split_k.py: the same partition count for one kv head, the same
partials), so few long requests still fill the GPU; the merge is this file's `_mla_merge_kernel`, which
walks the partitions row by row (split_k's one-tile merge holds 64 x 512 fp32 per program here). The grid depends only on host ints of
the metadata: CUDA-graph capturable. The step's latents are already written (attention/mla_ref.py:
write_latents), so request r attends to keys 0 .. seq_lens[r] - 1; rows with seq_len 0 (graph
padding) come back as zeros.

Reference: `mla_decode_ref` (= attention/mla_ref.py's `mla_attention_ref` on a decode-only batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_ref import mla_attention_ref
from pagedllm.envs import environment_variables
from pagedllm.kernels.attention_tile import _LOG2E
from pagedllm.kernels.split_k import alloc_partials, choose_num_splits, split_key_range, store_partials

__all__ = ["mla_decode", "mla_decode_ref"]

BLOCK_H = 16  # tl.dot's smallest M: heads past num_heads are masked rows
TILE_N = 32  # keys per tile: a (32, 512) bf16 latent tile is 32 KB
NUM_WARPS, NUM_STAGES = 4, 2  # not yet tuned on the GPU (scripts/gpu_mla_decode_sweep.py)
MAX_FIXED_SPLITS = 16  # fixed-size partitions per request at most (partials: T x H x 16 x 512 fp32)
# Batches of at least AUTO_CHUNK_MIN_REQS requests take fixed partitions of AUTO_SPLIT_CHUNK keys by
# default instead of choose_num_splits's equal shares: on the H200 at DeepSeek-V2-Lite's shape, W1-like
# lengths, graph-captured bounds (scripts/gpu_h41_bench.py, BENCHMARKS.md issue 24 / h41) 256 keys took
# 113 / 78 / 61 us against 140 / 89 / 65 at 256 / 128 / 64 requests (512 keys: 117 / 80 / 66).
# Smaller batches (not measured) keep the equal shares.
AUTO_CHUNK_MIN_REQS, AUTO_SPLIT_CHUNK = 64, 256
# PAGEDLLM_MLA_DECODE_CHUNKS (default 4; or 2, 1): decode batches take `_mla_decode_rc_kernel`, the latent's
# columns in that many chunks with the query reloaded per key tile; 0: `_mla_decode_kernel`, the query held
# in registers. H200, DeepSeek-V2-Lite's latent, 256-key partitions, tile (32, 4, 2) (scripts/gpu_h49_sweep.py,
# BENCHMARKS.md issue 24 / h49): 256 requests 94.3 against 114.4 us, 128 requests 85.0 against 98.7.
RC_CHUNKS = environment_variables["PAGEDLLM_MLA_DECODE_CHUNKS"]()


@triton.jit
def _partition_keys(seq_len, split, num_splits, split_chunk, TILE_N: tl.constexpr, USE_SPLIT: tl.constexpr,
                    FIXED_CHUNK: tl.constexpr):
    """Keys [kv_lo, kv_hi) of a request's partition `split`: FIXED_CHUNK, partition s holds keys
    [s * chunk, (s + 1) * chunk) (kv_lo >= seq_len: none); else split_k's equal shares (split_key_range).
        seq_len 300, split_chunk 256: partition 0 [0, 256), 1 [256, 300), 2 [512, 300) (none)"""
    if FIXED_CHUNK:
        kv_lo = split * split_chunk
        kv_hi = tl.minimum(seq_len, kv_lo + split_chunk)
    else:
        kv_lo, kv_hi = split_key_range(seq_len, split, num_splits, TILE_N, USE_SPLIT)
    return kv_lo, kv_hi


@triton.jit
def _softmax_tile(s, n_mask, m_i, l_i, scale_log2):
    """One online-softmax step over a key tile's raw scores s (BLOCK_H, TILE_N), keys past n_mask out:
    -> (p, alpha, m, l) with p = exp2(s * scale_log2 - m) the tile's weights, alpha = exp2(m_i - m) the
    factor that rescales the running output, m / l the new running max / sum (base 2, `_LOG2E`)."""
    s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit(do_not_specialize=["num_reqs", "num_heads", "num_splits", "split_chunk", "stride_bt"])
def _mla_decode_kernel(
    out_ptr,  # (num_tokens, num_heads, R) when not split
    part_acc_ptr,  # fp32 (num_tokens, num_heads, num_splits, R_PAD); only when USE_SPLIT
    part_m_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    part_l_ptr,
    q_ptr,  # (num_tokens, num_heads, R + P)
    cache_ptr,  # (num_blocks, block_size, R + P): layer cache [0, :, :, 0, :]
    block_table_ptr,  # int32 (num_reqs, max_blocks)
    seq_lens_ptr,  # int32 (num_reqs,)
    num_reqs,
    num_heads,
    num_splits,
    split_chunk,  # keys per partition when FIXED_CHUNK
    scale_log2,
    stride_q_t,
    stride_q_h,
    stride_o_t,
    stride_o_h,
    stride_c_blk,
    stride_c_slot,
    stride_bt,
    R: tl.constexpr,
    P: tl.constexpr,
    R_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FIXED_CHUNK: tl.constexpr = False,
):
    req = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    row = req.to(tl.int64)  # a decode request's one token
    seq_len = tl.load(seq_lens_ptr + req)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = offs_h < num_heads
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, P_PAD)
    r_mask = offs_r < R
    p_mask = offs_p < P
    q_rows = q_ptr + row * stride_q_t + offs_h[:, None] * stride_q_h
    q_lat = tl.load(q_rows + offs_r[None, :], mask=h_valid[:, None] & r_mask[None, :], other=0.0)  # (BLOCK_H, R_PAD)
    q_pe = tl.load(q_rows + R + offs_p[None, :], mask=h_valid[:, None] & p_mask[None, :], other=0.0)

    kv_lo, kv_hi = _partition_keys(seq_len, split, num_splits, split_chunk, TILE_N, USE_SPLIT, FIXED_CHUNK)
    if FIXED_CHUNK:
        if kv_lo >= seq_len:  # a fixed partition past the request's keys: the merge does not read it
            return
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(kv_lo, kv_hi, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_mask = offs_n < kv_hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        key_rows = cache_ptr + blk * stride_c_blk + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_c_slot
        c_kv = tl.load(key_rows[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(key_rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)  # (BLOCK_H, TILE_N) fp32
        p, alpha, m_i, l_i = _softmax_tile(s, n_mask, m_i, l_i, scale_log2)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=DOT_PRECISION)

    if USE_SPLIT:
        part = (row * num_heads + offs_h) * num_splits + split  # (BLOCK_H,)
        store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, h_valid, offs_r, R_PAD)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0 (padding): zeros
        tl.store(out_ptr + row * stride_o_t + offs_h[:, None] * stride_o_h + offs_r[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_valid[:, None] & r_mask[None, :])


@triton.jit
def _chunk_load(row_ptrs, c: tl.constexpr, RC: tl.constexpr, R: tl.constexpr, row_mask):
    """Columns [c * RC, (c + 1) * RC) of R-wide rows at row_ptrs (a 1-d tensor of row starts)."""
    cols = c * RC + tl.arange(0, RC)
    return tl.load(row_ptrs[:, None] + cols[None, :], mask=row_mask[:, None] & (cols < R)[None, :], other=0.0)


@triton.jit
def _chunk_store(ptrs, c: tl.constexpr, RC: tl.constexpr, R: tl.constexpr, row_mask, val):
    cols = c * RC + tl.arange(0, RC)
    tl.store(ptrs[:, None] + cols[None, :], val, mask=row_mask[:, None] & (cols < R)[None, :])


@triton.jit(do_not_specialize=["num_reqs", "num_heads", "num_splits", "split_chunk", "stride_bt"])
def _mla_decode_rc_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr,
    num_reqs, num_heads, num_splits, split_chunk, scale_log2,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_c_blk, stride_c_slot, stride_bt,
    R: tl.constexpr,
    P: tl.constexpr,
    R_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    USE_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FIXED_CHUNK: tl.constexpr = False,
    NUM_RC: tl.constexpr = 4,  # the latent's R columns in NUM_RC chunks of R_PAD // NUM_RC (1, 2 or 4)
):
    """`_mla_decode_kernel` (same arguments, partitions and results) with the latent's R columns in
    NUM_RC chunks: the query's chunks are loaded again at every key tile (from L1 / L2: 16 heads x 576
    x 2 B = 18 KB) instead of held in registers for the whole loop, and the output kept as NUM_RC
    accumulators. Held, the query is the A operand of every warp's score MMAs (16 x 512 bf16 = 128
    registers a thread at 4 warps): the one-piece kernel takes 204 registers on sm_90, so an SM holds
    2 of its programs; chunked, fewer registers and more programs an SM to hide the loads' latency.
        R 512, NUM_RC 4: scores = q_pe . k_pe + sum over c of q_lat[:, 128c:128(c+1)] . c_kv[:, 128c:...]"""
    RC: tl.constexpr = R_PAD // NUM_RC
    req = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    row = req.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = offs_h < num_heads
    offs_p = tl.arange(0, P_PAD)
    p_mask = offs_p < P
    q_rows = q_ptr + row * stride_q_t + offs_h * stride_q_h  # (BLOCK_H,) row starts

    kv_lo, kv_hi = _partition_keys(seq_len, split, num_splits, split_chunk, TILE_N, USE_SPLIT, FIXED_CHUNK)
    if FIXED_CHUNK:
        if kv_lo >= seq_len:  # a fixed partition past the request's keys: the merge does not read it
            return
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, RC], tl.float32)
    if NUM_RC > 1:
        acc1 = tl.zeros([BLOCK_H, RC], tl.float32)
    if NUM_RC > 2:
        acc2 = tl.zeros([BLOCK_H, RC], tl.float32)
        acc3 = tl.zeros([BLOCK_H, RC], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start_n in range(kv_lo, kv_hi, TILE_N):
        offs_n = start_n + tl.arange(0, TILE_N)
        n_mask = offs_n < kv_hi
        blk = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        key_rows = cache_ptr + blk * stride_c_blk + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_c_slot
        k_pe = tl.load(key_rows[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        q_pe = tl.load(q_rows[:, None] + R + offs_p[None, :], mask=h_valid[:, None] & p_mask[None, :], other=0.0)
        s = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        c0 = _chunk_load(key_rows, 0, RC, R, n_mask)
        s += tl.dot(_chunk_load(q_rows, 0, RC, R, h_valid), tl.trans(c0), input_precision=DOT_PRECISION)
        if NUM_RC > 1:
            c1 = _chunk_load(key_rows, 1, RC, R, n_mask)
            s += tl.dot(_chunk_load(q_rows, 1, RC, R, h_valid), tl.trans(c1), input_precision=DOT_PRECISION)
        if NUM_RC > 2:
            c2 = _chunk_load(key_rows, 2, RC, R, n_mask)
            s += tl.dot(_chunk_load(q_rows, 2, RC, R, h_valid), tl.trans(c2), input_precision=DOT_PRECISION)
            c3 = _chunk_load(key_rows, 3, RC, R, n_mask)
            s += tl.dot(_chunk_load(q_rows, 3, RC, R, h_valid), tl.trans(c3), input_precision=DOT_PRECISION)
        p, alpha, m_i, l_i = _softmax_tile(s, n_mask, m_i, l_i, scale_log2)
        pv = p.to(c0.dtype)
        acc0 = acc0 * alpha[:, None] + tl.dot(pv, c0, input_precision=DOT_PRECISION)
        if NUM_RC > 1:
            acc1 = acc1 * alpha[:, None] + tl.dot(pv, c1, input_precision=DOT_PRECISION)
        if NUM_RC > 2:
            acc2 = acc2 * alpha[:, None] + tl.dot(pv, c2, input_precision=DOT_PRECISION)
            acc3 = acc3 * alpha[:, None] + tl.dot(pv, c3, input_precision=DOT_PRECISION)

    if USE_SPLIT:
        part = (row * num_heads + offs_h) * num_splits + split  # (BLOCK_H,)
        tl.store(part_m_ptr + part, m_i, mask=h_valid)
        tl.store(part_l_ptr + part, l_i, mask=h_valid)
        dst = part_acc_ptr + part * R_PAD
        _chunk_store(dst, 0, RC, R_PAD, h_valid, acc0)
        if NUM_RC > 1:
            _chunk_store(dst, 1, RC, R_PAD, h_valid, acc1)
        if NUM_RC > 2:
            _chunk_store(dst, 2, RC, R_PAD, h_valid, acc2)
            _chunk_store(dst, 3, RC, R_PAD, h_valid, acc3)
    else:
        inv = 1.0 / tl.where(l_i == 0.0, 1.0, l_i)  # seq_len 0 (padding): zeros
        dst = out_ptr + row * stride_o_t + offs_h * stride_o_h
        ty = out_ptr.dtype.element_ty
        _chunk_store(dst, 0, RC, R, h_valid, (acc0 * inv[:, None]).to(ty))
        if NUM_RC > 1:
            _chunk_store(dst, 1, RC, R, h_valid, (acc1 * inv[:, None]).to(ty))
        if NUM_RC > 2:
            _chunk_store(dst, 2, RC, R, h_valid, (acc2 * inv[:, None]).to(ty))
            _chunk_store(dst, 3, RC, R, h_valid, (acc3 * inv[:, None]).to(ty))


@triton.jit(do_not_specialize=["num_reqs", "num_heads", "num_splits", "split_chunk"])
def _mla_merge_kernel(
    out_ptr,  # (num_tokens, num_heads, R)
    part_acc_ptr,  # fp32 (num_tokens, num_heads, num_splits, R_PAD)
    part_m_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    part_l_ptr,
    seq_lens_ptr,  # int32 (num_reqs,); read when FIXED_CHUNK
    num_reqs,
    num_heads,
    num_splits,
    split_chunk,
    stride_o_t,
    stride_o_h,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    FIXED_CHUNK: tl.constexpr = False,
):
    """The split partitions of one (request, head) merged. split_k's merge loads every split's
    accumulator as one (SPLITS_PAD, width) tile: 64 x 512 fp32 here, far past the registers; this
    one walks the splits, one 512-wide row at a time."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * num_heads + h) * num_splits
    if FIXED_CHUNK:  # only the partitions that hold keys were written
        num_splits = tl.cdiv(tl.load(seq_lens_ptr + t), split_chunk)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key at all (seq_len 0): weights 0
    denom = tl.sum(tl.math.exp2(m - m_max) * l_s, 0)
    offs_r = tl.arange(0, R_PAD)
    acc = tl.zeros([R_PAD], tl.float32)
    for s in range(num_splits):
        w = tl.math.exp2(tl.load(part_m_ptr + base + s) - m_max)  # empty partition: m = -inf -> 0
        acc += w * tl.load(part_acc_ptr + (base + s) * R_PAD + offs_r)
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + t * stride_o_t + h * stride_o_h + offs_r, out.to(out_ptr.dtype.element_ty), mask=offs_r < R)


def mla_decode(
    query: torch.Tensor,  # (num_tokens, num_heads, R + P): [q_lat | q_pe]
    kv_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, R + P), this step's latents written
    md: AttentionMetadata,
    scale: float,
    kv_lora_rank: int,  # R
    num_splits: int | None = None,
    tile: tuple[int, int, int] | None = None,  # (TILE_N, num_warps, num_stages); None: the defaults above
    split_chunk: int | None = None,  # fixed-size key partitions (a multiple of TILE_N); overrides num_splits
    num_rc: int | None = None,  # 1, 2 or 4: `_mla_decode_rc_kernel` with the latent in that many chunks;
    # None: RC_CHUNKS (PAGEDLLM_MLA_DECODE_CHUNKS; 0 = the one-piece kernel)
) -> torch.Tensor:  # (num_tokens, num_heads, R)
    """MQA over the latent cache for a decode-only batch (md.max_query_len == 1, one token a request).

    Partitions: num_splits equal shares of each request's keys (split_key_range), or with split_chunk
    (by default AUTO_SPLIT_CHUNK from AUTO_CHUNK_MIN_REQS requests on, when neither is given)
    fixed runs of that many keys, cdiv(max_seq_len, split_chunk) of them (at most MAX_FIXED_SPLITS:
    the chunk grows for long contexts), so every program does at most one chunk's work whatever its
    request's length and a batch of mixed lengths is not paced by its longest request."""
    if md.max_query_len != 1 or md.num_actual_tokens != md.num_reqs:
        raise ValueError(f"mla_decode takes decode-only batches, got max_query_len {md.max_query_len} and "
                         f"{md.num_actual_tokens} tokens for {md.num_reqs} requests")
    t, num_heads, width = query.shape
    r, p = kv_lora_rank, width - kv_lora_rank
    out = torch.empty((t, num_heads, r), dtype=query.dtype, device=query.device)
    n = md.num_reqs
    if t > n:
        out[n:].zero_()
    if n == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    cache = kv_cache[0, :, :, 0, :]  # (num_blocks, block_size, W), a view
    r_pad, p_pad = max(16, triton.next_power_of_2(r)), max(16, triton.next_power_of_2(p))
    tile_n, num_warps, num_stages = tile or (TILE_N, NUM_WARPS, NUM_STAGES)
    if split_chunk is None and num_splits is None and n >= AUTO_CHUNK_MIN_REQS and AUTO_SPLIT_CHUNK % tile_n == 0:
        split_chunk = AUTO_SPLIT_CHUNK
    fixed = split_chunk is not None
    if fixed:
        if split_chunk <= 0 or split_chunk % tile_n:
            raise ValueError(f"split_chunk {split_chunk} must be a positive multiple of TILE_N {tile_n}")
        split_chunk = max(split_chunk, triton.cdiv(triton.cdiv(md.max_seq_len, MAX_FIXED_SPLITS), tile_n) * tile_n)
        num_splits = triton.cdiv(md.max_seq_len, split_chunk)
    elif num_splits is None:
        num_splits = choose_num_splits(n, 1, 1, md.max_seq_len)
    use_split = num_splits > 1
    fixed = fixed and use_split
    if use_split:
        part_acc, part_m, part_l = alloc_partials(t, num_heads, num_splits, r_pad, query.device)
    else:
        part_acc = part_m = part_l = out  # never touched: USE_SPLIT is a compile-time False
    if num_rc is None:  # the default, halved until its chunks are >= 16 columns (a narrow test latent)
        num_rc = RC_CHUNKS
        while num_rc > 1 and r_pad // num_rc < 16:
            num_rc //= 2
    if num_rc not in (0, 1, 2, 4) or (num_rc and r_pad // num_rc < 16):
        raise ValueError(f"mla_decode: num_rc must be 0, 1, 2 or 4 with chunks of >= 16 columns, got {num_rc} "
                         f"for kv_lora_rank {r}")
    kernel, extra = (_mla_decode_rc_kernel, dict(NUM_RC=num_rc)) if num_rc else (_mla_decode_kernel, {})
    kernel[(n, triton.cdiv(num_heads, BLOCK_H), num_splits)](
        out, part_acc, part_m, part_l, query, cache, md.block_table, md.seq_lens,
        n, num_heads, num_splits, split_chunk or 0, scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), md.block_table.stride(0),
        R=r, P=p, R_PAD=r_pad, P_PAD=p_pad, BLOCK_H=BLOCK_H, TILE_N=tile_n, BLOCK_SIZE=kv_cache.shape[2],
        USE_SPLIT=use_split, DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", FIXED_CHUNK=fixed,
        num_warps=num_warps, num_stages=num_stages, **extra,
    )
    if use_split:
        _mla_merge_kernel[(n, num_heads)](
            out, part_acc, part_m, part_l, md.seq_lens, n, num_heads, num_splits, split_chunk or 0,
            out.stride(0), out.stride(1), R=r, R_PAD=r_pad, SPLITS_PAD=max(64, triton.next_power_of_2(num_splits)),
            FIXED_CHUNK=fixed, num_warps=4,
        )
    return out


def mla_decode_ref(query: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                   kv_lora_rank: int) -> torch.Tensor:
    """The plain torch MQA over the latent cache (attention/mla_ref.py), for the same inputs."""
    latent = torch.zeros((query.shape[0], query.shape[2]), dtype=query.dtype, device=query.device)  # unused
    return mla_attention_ref(query, latent, kv_cache, md, scale, kv_lora_rank)
