"""The pieces the paged attention kernels share: one online-softmax step over a tile of cached keys
(`_attend_tile`, a Triton device function) and the tile sizes a launch uses (`_tile_config`).
`paged_attention.py` (prefill chunks and decodes) and `decode_attention.py` (decodes with the q/k
prep fused in) both build on them, so a tuning or masking fix lands in both at once.

Scores are kept in base 2: the callers pass scale * log2(e) (`_LOG2E`), and exp2 replaces exp.
"""

from __future__ import annotations

import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, q_pos,
    stride_c_blk, stride_c_slot, scale_log2, window, soft_cap_log2,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MASKED: tl.constexpr,
    USE_WINDOW: tl.constexpr = False,
    USE_SOFTCAP: tl.constexpr = False,
):
    """One online-softmax update with keys start_n .. start_n + TILE_N - 1.

    q (BLOCK_M, HEAD_DIM_PAD); m_i, l_i (BLOCK_M,) fp32; acc (BLOCK_M, HEAD_DIM_PAD) fp32.
    MASKED=False promises every key valid (< kv_hi) and visible to every row (<= its q_pos).
    USE_WINDOW: a row sees only keys > q_pos - window (sliding window; needs MASKED).
    USE_SOFTCAP: scores s become cap * tanh(s / cap) (Gemma 2), here in base 2: soft_cap_log2 = cap * log2(e).
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_pos = start_n + offs_n
    if MASKED:
        k_valid = k_pos < kv_hi
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + k_pos // BLOCK_SIZE).to(tl.int64)
    slot_off = blk * stride_c_blk + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot + head_off
    k_ptrs = k_cache_ptr + slot_off[None, :] + offs_d[:, None]  # (HEAD_DIM_PAD, TILE_N)
    v_ptrs = v_cache_ptr + slot_off[:, None] + offs_d[None, :]  # (TILE_N, HEAD_DIM_PAD)
    # Masked lanes read 0, never stale cache memory (which may hold NaN/inf bit patterns).
    if MASKED:
        k = tl.load(k_ptrs, mask=k_valid[None, :] & (offs_d[:, None] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < HEAD_DIM, other=0.0)
    # An fp8 cache with bf16 queries computes in fp16: e4m3 -> fp16 is one cvt per two values on
    # sm_90, while e4m3 -> bf16 goes through fp16 and fp32 (three), which made the fp8 cache slower
    # than bf16 in decode. Every K / V / P value fits fp16 (|fp8| <= 448, P in [0, 1]); q is clamped
    # to fp16's range (a bf16 q beyond 65504 would otherwise become inf), and keeps more mantissa.
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:  # decided at compile time
        qc = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        qc = q
    s = tl.dot(qc, k.to(qc.dtype), input_precision=DOT_PRECISION) * scale_log2  # (BLOCK_M, TILE_N)
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without NaN when exp overflows.
        s = soft_cap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * s / soft_cap_log2) + 1.0))
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_valid[None, :]
        if USE_WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_shift = m_new
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=k_valid[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM == HEAD_DIM_PAD:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(qc.dtype), v.to(qc.dtype), input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_tile_keys_m(
    qt, m_i, l_t, acc_t, k_cache_ptr, v_cache_ptr, bt_row, head_off, start_n, kv_hi, scale_log2,
    stride_c_blk, stride_c_slot,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """`_attend_tile` for a decode row group with the keys as the MMA's M dimension (transposed):

        s^T (TILE_N, BLOCK_M)   = K (TILE_N, D) @ q^T (D, BLOCK_M)
        acc^T (D, BLOCK_M)     += V^T (D, TILE_N) @ p^T (TILE_N, BLOCK_M)

    so a GQA group of 4 query heads pads the MMA's N (16) instead of its M (64 for Hopper's wgmma),
    and K is the left operand, read from shared memory in its stored (key, d) order, which fp8 wgmma
    needs (K-major); V is converted to fp16 (fp8 operands must be K-major, V's keys are not).
    qt (HEAD_DIM_PAD, BLOCK_M): q^T in e4m3 (scale_log2 then (1, BLOCK_M): the row scales folded in)
    or in the cache's 16-bit dtype. Every key below kv_hi is visible (decode: q_pos = context).
    m_i (BLOCK_M,) fp32; l_t (TILE_N, BLOCK_M) fp32: the softmax denominators per key slot of the tile,
    summed over the keys once after the loop (`tl.sum(l_t, 0)`), not every tile: the keys run across the
    warps of Hopper's wgmma, so each sum over them is a reduction through shared memory with two block
    barriers (sm_90 SASS: 10 barriers a 128-key tile against 12 summing each tile; on the H200 the fp8 decode
    kernel ~4% faster, W1 with an fp8 cache +2.1%: BENCHMARKS.md, issue 19, twentieth session); acc_t
    (HEAD_DIM_PAD, BLOCK_M) fp32.
    """
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    k_pos = start_n + offs_n
    k_valid = k_pos < kv_hi
    blk = tl.load(bt_row + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    slot_off = blk * stride_c_blk + (k_pos % BLOCK_SIZE).to(tl.int64) * stride_c_slot + head_off
    kv_mask = k_valid[:, None] & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # (TILE_N, D)
    if qt.dtype == tl.float8e4nv:
        s = tl.dot(k, qt, out_dtype=tl.float32) * scale_log2  # (TILE_N, BLOCK_M)
    else:
        s = tl.dot(k.to(qt.dtype), qt, input_precision=DOT_PRECISION) * scale_log2
    s = tl.where(k_valid[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: a tile holds >= 1 valid key
    p = tl.math.exp2(s - m_new[None, :])
    alpha = tl.math.exp2(m_i - m_new)
    l_t = l_t * alpha[None, :] + p
    v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # (TILE_N, D)
    if v.dtype == tl.float8e4nv:
        pv = tl.dot(tl.trans(v.to(tl.float16)), p.to(tl.float16))
    else:
        pv = tl.dot(tl.trans(v.to(qt.dtype)), p.to(qt.dtype), input_precision=DOT_PRECISION)
    acc_t = acc_t * alpha[None, :] + pv
    return m_new, l_t, acc_t


def _tile_config(queries_per_kv: int, head_dim_pad: int, decode_only: bool,
                 few_programs: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_Q, TILE_N, num_warps, num_stages), tuned on the H200 with
    `scripts/attn_sweep.py` (2026-11-29, head_dim 128, bf16, W1-like batches).

    Decode rows are memory bound: the smallest MMA tile (16 rows) holds the GQA group of one token,
    and 128-key tiles 3 stages deep stream K/V fastest (256 requests x ~800 keys: 215 us, 3.9 TB/s;
    64-key tiles 220-227 us); an unsplit decode batch of at most FEW_DECODE_PROGRAMS (request, kv
    head) programs (`few_programs`) is faster with 64-key tiles, 2 stages (split_k.py). Prefill tiles use 64 rows so each K/V tile is reused by up to 64
    (token, head) rows; 32-key tiles beat 64 and 128-row tiles (8192-token mixed batch: 200 vs 210 us
    for 16/8 heads, 318 vs 336 us for 32/8). tl.dot needs every dimension >= 16.
    """
    if head_dim_pad > 256:
        # MLA's latent (DeepSeek: 512 + 64 = 576, padded to 1024): the smallest tiles, one stage, so
        # q, acc and a K/V tile fit the registers and shared memory (64-row tiles need 393 KB of it).
        block_m = max(16, triton.next_power_of_2(queries_per_kv))
        return block_m, max(1, block_m // queries_per_kv), 16, 8, 1
    rows = 16 if decode_only else 64
    block_m = max(rows, triton.next_power_of_2(queries_per_kv))
    block_q = max(1, block_m // queries_per_kv)
    if head_dim_pad <= 128:
        # Few programs: 64-key tiles, except for GQA groups of 8 and more query heads (Qwen3-30B-A3B's
        # 32 / 4), whose bigger score and value products per tile keep 128 keys: 96 requests x 900-2000
        # keys on the H200, 88.2 us against 98.9 (BENCHMARKS.md, issue 24, branch h49).
        few_tile = 128 if queries_per_kv >= 8 else 64
        tile_n = (few_tile if few_programs else 128) if decode_only else 32
        num_warps = 4
        if decode_only and few_programs:  # an unsplit decode batch of few programs (split_k.py)
            return block_m, block_q, tile_n, num_warps, 2
    else:
        tile_n, num_warps = 32, 8
    return block_m, block_q, tile_n, num_warps, 3
