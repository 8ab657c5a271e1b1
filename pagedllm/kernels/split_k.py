"""Split-K (flash decoding) for the paged-attention kernel: how many key partitions, and the merge.

With few requests and long contexts, (requests x kv heads) attention programs cannot fill the GPU,
so `paged_attention` cuts each query tile's keys into num_splits chunks run by separate programs.
Each writes an unnormalised partial result: acc (its rows' p @ V), m (running max, base 2) and l (the
sum of 2^(s - m)). The merge kernel here combines them per (token, query head):

    out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s,    M = max_s m_s

Example: 2 splits with m = (3, 1), l = (2, 4): weights (1, 1/4); denominator 2 + 1 = 3.
Empty splits (a short context cut many ways) have m = -inf and drop out (weight 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.metadata import AttentionMetadata

__all__ = ["FEW_DECODE_PROGRAMS", "alloc_partials", "choose_num_splits", "decode_kind", "merge_splits"]

# Split-K heuristic: aim for ~8 programs per SM on an H200 (132 SMs) — a decode program streams
# K/V with little compute, so memory-level parallelism, not waves, sets its speed (measured: 2048
# programs of a 256-request batch reach ~3.9 TB/s) — give each split at least this many keys
# (fewer and the merge costs more than it saves), and cap the split count. From _NO_SPLIT_PROGRAMS
# (request, kv head) pairs up, one program per pair already streams fast enough that the merge
# does not pay: Llama-3.1-8B heads, contexts of 800-2000 keys, timed in CUDA graphs with the graphs'
# max_seq_len of 4096 (2026-11-30): 32 requests 59.2 us unsplit vs 64.5 us with 4 splits, 64
# requests 97.9 vs 104.0 with 2; 16 requests (128 pairs) keep 8 splits: 37.9 vs 39.5 us with 2.
_TARGET_PROGRAMS = 1024
_NO_SPLIT_PROGRAMS = 256
# Unsplit decode batches of at most this many (request, kv head) programs stream K/V in 64-key
# tiles, 2 stages (kernels/paged_attention.py `_tile_config`): with so few programs an SM holds
# one or two 128-key programs and stalls between tiles, while smaller tiles keep more of them in
# flight. Llama-3.1-8B heads, 64 requests, CUDA graphs (2026-12-01): 128-key tiles 80.8 / 152.2 /
# 223.6 / 295.1 us at 1000 / 2000 / 3000 / 4000 keys, 64-key tiles 70.9 / 134.8 / 188.9 / 254.2 us
# (0.86-0.97 of the K/V bytes at 4.3 TB/s); at 256 requests (2048 programs) 64-key tiles were
# 2-10% slower (BENCHMARKS.md), so larger batches keep 128.
FEW_DECODE_PROGRAMS = 512
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 64


@triton.jit
def split_key_range(kv_end, split, num_splits, TILE_N: tl.constexpr, USE_SPLIT: tl.constexpr):
    """Keys [kv_lo, kv_hi) of partition `split` of 0 .. kv_end: whole TILE_N tiles per partition, the
    last one ragged, trailing ones empty. Example: 300 keys, 4 splits, TILE_N 64 -> 128 keys each:
    [0, 128), [128, 256), [256, 300), [384, 300) (empty). Without split-K: [0, kv_end)."""
    if USE_SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end, num_splits), TILE_N) * TILE_N
        kv_lo = split * chunk
        kv_hi = tl.minimum(kv_end, kv_lo + chunk)
    else:
        kv_lo = kv_end * 0
        kv_hi = kv_end
    return kv_lo, kv_hi


@triton.jit
def store_partials(part_acc_ptr, part_m_ptr, part_l_ptr, part, m_i, l_i, acc, row_valid, offs_d,
                   HEAD_DIM_PAD: tl.constexpr):
    """Write one program's unnormalised rows for `_merge_splits_kernel`. part (BLOCK_M,): each row's
    index (token * num_heads + head) * num_splits + split; acc (BLOCK_M, HEAD_DIM_PAD)."""
    tl.store(part_m_ptr + part, m_i, mask=row_valid)
    tl.store(part_l_ptr + part, l_i, mask=row_valid)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_valid[:, None])


@triton.jit(do_not_specialize=["num_reqs", "num_splits"])
def _merge_splits_kernel(
    out_ptr,  # (num_tokens, num_heads, head_dim)
    part_acc_ptr,  # fp32 (num_tokens, num_heads, num_splits, HEAD_DIM_PAD)
    part_m_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    part_l_ptr,  # fp32 (num_tokens, num_heads, num_splits)
    query_start_loc_ptr,  # int32 (>= num_reqs + 1,)
    num_reqs,
    num_heads,
    num_splits,
    stride_o_t,
    stride_o_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    # One program per (token, query head); rows past the last request's tokens (padding) hold no
    # partial results and keep the zeros the wrapper wrote.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if t >= tl.load(query_start_loc_ptr + num_reqs):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    base = (t * num_heads + h) * num_splits
    m = tl.load(part_m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(part_l_ptr + base + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: m = -inf -> 0
    denom = tl.sum(w * l_s, 0)
    acc = tl.load(
        part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=s_mask[:, None],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + t * stride_o_t + h * stride_o_h + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int) -> int:
    """How many key partitions per query tile: 1 (no split) unless a decode-only batch has fewer
    than _NO_SPLIT_PROGRAMS (request, kv head) pairs and long contexts. Uses host ints only.

    Example: 1 request, 8 kv heads, 4096-token context -> min(256 / 8, 4096 / 256) = 16 splits.
    """
    if max_query_len != 1 or num_reqs == 0:
        return 1
    programs = num_reqs * num_kv_heads
    if programs >= _NO_SPLIT_PROGRAMS:
        return 1
    splits = min(
        triton.cdiv(_TARGET_PROGRAMS, programs),
        max_seq_len // _MIN_KEYS_PER_SPLIT,
        _MAX_SPLITS,
    )
    if splits < 2:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down to a power of two: fewer kernel variants


def alloc_partials(
    num_tokens: int, num_heads: int, num_splits: int, head_dim_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty fp32 buffers for the split programs' (acc, m, l): (T, H, S, HEAD_DIM_PAD), (T, H, S) x 2."""
    part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad), dtype=torch.float32, device=device)
    part_m = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device)
    return part_acc, part_m, torch.empty_like(part_m)


def merge_splits(
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim): rows past the batch's tokens are left alone
    part_acc: torch.Tensor,  # fp32 (num_tokens, num_heads, num_splits, HEAD_DIM_PAD)
    part_m: torch.Tensor,  # fp32 (num_tokens, num_heads, num_splits)
    part_l: torch.Tensor,  # fp32 (num_tokens, num_heads, num_splits)
    md: AttentionMetadata,
) -> None:
    """Write the merged attention output of every split query row into `out`."""
    num_tokens, num_heads, head_dim = out.shape
    num_splits, head_dim_pad = part_acc.shape[2], part_acc.shape[3]
    _merge_splits_kernel[(num_tokens, num_heads)](
        out,
        part_acc,
        part_m,
        part_l,
        md.query_start_loc,
        md.num_reqs,
        num_heads,
        num_splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        # One padded width for every split count: one compiled variant, not one per count.
        SPLITS_PAD=max(_MAX_SPLITS, triton.next_power_of_2(num_splits)),
        num_warps=4,
    )


def decode_kind(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> tuple[int, bool]:
    """How a decode-only batch attends: (split count, 64-key tiles?). Batches of one kind time
    alike, so the CUDA-graph plan pads a batch only to a graph of the same kind (worker/graph_plan.py)."""
    splits = choose_num_splits(num_reqs, num_kv_heads, 1, max_seq_len)
    return splits, splits == 1 and num_reqs * num_kv_heads <= FEW_DECODE_PROGRAMS
