"""Sorting a MoE step's (token, slot) pairs by expert, on the GPU, and its torch reference.

moe_align_block_size sorts the T * top_k pairs by expert and pads each expert's run to a multiple of
BLOCK_M, so every BLOCK_M rows of the sorted list belong to one expert (the grouped GEMMs of
kernels/moe_grouped_gemm.py take one expert's weight per row block):
    top_k 2, topk_ids [[2, 0], [2, 1]], BLOCK_M 4 -> pairs by expert: e0 [1], e1 [3], e2 [0, 2]
    sorted_token_ids [1, P, P, P, 3, P, P, P, 0, 2, P, P]  (P = 4 = T * top_k: padding)
    expert_ids       [0, 1, 2]   (one per BLOCK_M rows), num_tokens_post_padded [12]

Three ways to the same list: one Triton program (`_moe_align_kernel`, decode to mid sizes), two
launches from per-expert row lists (`moe_align_block_size_rows`, prefill sizes), and the torch
reference `moe_align_block_size_ref`. The per-expert row lists (`_moe_expert_rows_kernel`) are also
what the row-list GEMMs of kernels/moe_row_lists.py take directly, with no sorted list at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.envs import kernel_switches

__all__ = ["moe_align_block_size", "moe_align_block_size_ref", "moe_align_block_size_rows"]


def _max_padded(num_pairs: int, block_m: int, num_experts: int) -> int:
    """Static size of the sorted list: every expert hit may pad its run by up to block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


@triton.jit
def _moe_align_kernel(
    topk_ids_ptr,  # (num_pairs,) expert of each (token, slot) pair
    sorted_ids_ptr,  # int32 (max_padded,) out
    expert_ids_ptr,  # int32 (max_padded / BLOCK_M,) out
    ntpp_ptr,  # int32 (1,) out: num_tokens_post_padded
    cursor_ptr,  # int32 (num_experts,) scratch: counts, then each expert's next free row
    num_pairs,
    num_experts,
    max_padded,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= num_experts
    CHUNK: tl.constexpr,
    CHUNK_J: tl.constexpr,
):
    """moe_align_block_size in one program (one launch instead of ~20 torch ops, which cost more
    than the GEMMs at decode batch sizes). Rows within an expert's run are taken with atomics, so
    their order may differ from the reference's; every pair still lands once in its expert's run,
    and each output row depends on its own pair only."""
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    offs = tl.arange(0, CHUNK)
    # 1. tokens per expert.
    tl.atomic_xchg(cursor_ptr + offs_e, tl.zeros([BLOCK_E], tl.int32), mask=e_mask)
    for start in range(0, max_padded, CHUNK):  # every row starts as padding (= num_pairs)
        tl.store(sorted_ids_ptr + start + offs, tl.full([CHUNK], 0, tl.int32) + num_pairs,
                 mask=start + offs < max_padded)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        m = start + offs < num_pairs
        ids = tl.load(topk_ids_ptr + start + offs, mask=m, other=0)
        tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=m)
    tl.debug_barrier()
    # 2. runs padded to BLOCK_M: [padded_start, padded_end) per expert.
    # The scratch is only touched with atomics (served by L2), so no thread reads a stale L1 line.
    counts = tl.where(e_mask, tl.atomic_add(cursor_ptr + offs_e, tl.zeros([BLOCK_E], tl.int32), mask=e_mask), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    tl.store(ntpp_ptr, tl.sum(padded, 0))
    # 3. the expert of every BLOCK_M rows: experts whose run ends at or before the block's start
    # (searchsorted right), clamped for the blocks past the last run (the GEMM skips those).
    ends = tl.where(e_mask, padded_end, 2147483647)
    num_blocks = max_padded // BLOCK_M
    for jb in range(0, num_blocks, CHUNK_J):
        j = jb + tl.arange(0, CHUNK_J)
        e_of = tl.sum((ends[None, :] <= (j * BLOCK_M)[:, None]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + j, tl.minimum(e_of, num_experts - 1), mask=j < num_blocks)
    # 4. every pair to the next free row of its expert's run.
    tl.debug_barrier()
    tl.atomic_xchg(cursor_ptr + offs_e, padded_end - padded, mask=e_mask)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        m = start + offs < num_pairs
        ids = tl.load(topk_ids_ptr + start + offs, mask=m, other=0)
        row = tl.atomic_add(cursor_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=m)
        tl.store(sorted_ids_ptr + row, (start + offs).to(tl.int32), mask=m)


# The one-program align is serial in its atomics: on the H200 it takes 7 us against torch's 42 at
# decode sizes, but 507 us against 131 at 65,536 pairs (8,192 tokens x 8). Above this many pairs
# the torch version (a few parallel kernels) runs instead; prefill chunks that big are GEMM-bound.
ALIGN_KERNEL_MAX_PAIRS = 8192
# From this many pairs on (CUDA, PAGEDLLM_MOE_ALIGN_ROWS) the two-launch version from row lists runs
# instead of either (`moe_align_block_size_rows`). H200: the one-program kernel took 15.3 / 23.4 us at
# 1,024 / 2,048 pairs, the list kernel 2.3 / 3.4 us (h45 round 3); the two launches 60 us at 65,536
# pairs against the torch version's 136 (h49 round 1). Fewer pairs keep the one-program kernel.
ALIGN_ROWS_MIN_PAIRS = 1024
# PAGEDLLM_MOE_ALIGN_ROWS=1: steps past ALIGN_KERNEL_MAX_PAIRS sort their pairs with `moe_align_block_size_rows`.
_ALIGN_ROWS = kernel_switches().moe_align_rows


def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> sorted_token_ids int32 (max_padded,), expert_ids int32 (max_padded / block_m,),
    num_tokens_post_padded int32 (1,) (see the module docstring; `_max_padded` gives the static
    size). One Triton program below ALIGN_ROWS_MIN_PAIRS pairs, two launches from row lists from there
    (`moe_align_block_size_rows`; with PAGEDLLM_MOE_ALIGN_ROWS=0 the program up to ALIGN_KERNEL_MAX_PAIRS
    and `moe_align_block_size_ref`, the torch version, above)."""
    flat = topk_ids.reshape(-1).contiguous()
    m = flat.numel()
    if _ALIGN_ROWS and flat.is_cuda and m >= ALIGN_ROWS_MIN_PAIRS:
        return moe_align_block_size_rows(topk_ids, block_m, num_experts)
    if m > ALIGN_KERNEL_MAX_PAIRS:
        return moe_align_block_size_ref(topk_ids, block_m, num_experts)
    max_padded = _max_padded(m, block_m, num_experts)
    device = flat.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    ntpp = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    _moe_align_kernel[(1,)](
        flat, sorted_ids, expert_ids, ntpp, cursor, m, num_experts, max_padded,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=1024, CHUNK_J=max(1, min(64, 8192 // block_e)), num_warps=4,
    )
    return sorted_ids, expert_ids, ntpp


@triton.jit
def _moe_expert_rows_kernel(
    topk_ids_ptr,  # int32 (num_pairs,): the expert of each (token, slot) pair
    rows_ptr,  # int32 (E, max_rows) out: each expert's pairs in pair order
    counts_ptr,  # int32 (E,) out: each expert's number of pairs
    num_pairs,
    max_rows,
    CHUNK: tl.constexpr,
):
    """The align step for decode-sized batches, one program per expert (no atomics, no padding):
    expert e scans the step's ids and writes the pairs routed to it at their rank.
        topk_ids [3, 1, 3, 0, 3], expert 3 -> rows[3, :3] = [0, 2, 4], counts[3] = 3"""
    expert = tl.program_id(0)
    row_list = rows_ptr + expert.to(tl.int64) * max_rows
    count = tl.sum(tl.zeros([CHUNK], tl.int32), 0)
    for p0 in range(0, num_pairs, CHUNK):
        offs_p = p0 + tl.arange(0, CHUNK)
        hit = tl.load(topk_ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1) == expert
        rank = count + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(row_list + rank, offs_p, mask=hit)
        count += tl.sum(hit.to(tl.int32), 0)
    tl.store(counts_ptr + expert, count)


@triton.jit
def _moe_rows_to_sorted_kernel(
    rows_ptr,  # int32 (E, max_rows): `_moe_expert_rows_kernel`'s lists
    counts_ptr,  # int32 (E,)
    sorted_ids_ptr,  # int32 (max_padded,) out
    expert_ids_ptr,  # int32 (max_padded / BLOCK_M,) out
    ntpp_ptr,  # int32 (1,) out
    num_experts,
    max_rows,
    num_pairs,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program e copies expert e's list into its run of the sorted list (padded to BLOCK_M with
    num_pairs) at the sum of the earlier experts' padded counts, and names itself in expert_ids for
    its run's blocks. counts [3, 1], BLOCK_M 4 -> expert 1 starts at row 4: sorted [.., .., .., P, x, P, P, P]."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
    count = tl.load(counts_ptr + e)
    mine = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if e == 0:
        tl.store(ntpp_ptr, tl.sum(padded, 0))
    row_list = rows_ptr + e.to(tl.int64) * max_rows
    for r0 in range(0, mine, CHUNK):
        r = r0 + tl.arange(0, CHUNK)
        v = tl.load(row_list + r, mask=r < count, other=num_pairs)
        tl.store(sorted_ids_ptr + start + r, v, mask=r < mine)
    for b0 in range(0, mine // BLOCK_M, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        tl.store(expert_ids_ptr + start // BLOCK_M + b, tl.zeros([CHUNK], tl.int32) + e, mask=b < mine // BLOCK_M)


def moe_align_block_size_rows(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align_block_size` in two parallel launches for prefill-sized steps: each expert lists its
    pairs (`_moe_expert_rows_kernel`, one program per expert), then copies them into its padded run
    (`_moe_rows_to_sorted_kernel`). Pairs keep pair order inside a run, as the torch reference's
    stable sort: the same sorted list, expert ids and padded count (rows past that count are not
    written; the GEMMs never read them). The one-program kernel's atomics are serial (507 us at
    65,536 pairs on the H200), the torch version ~20 launches (131 us)."""
    t = topk_ids.shape[0]
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32 or not flat.is_contiguous():
        flat = flat.to(torch.int32).contiguous()
    m = flat.numel()
    device = flat.device
    max_padded = _max_padded(m, block_m, num_experts)
    rows = torch.empty((num_experts, t), dtype=torch.int32, device=device)  # an expert takes a token at most once
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    ntpp = torch.empty(1, dtype=torch.int32, device=device)
    _moe_expert_rows_kernel[(num_experts,)](flat, rows, counts, m, t, CHUNK=1024, num_warps=4)
    _moe_rows_to_sorted_kernel[(num_experts,)](rows, counts, sorted_ids, expert_ids, ntpp, num_experts, t, m,
                                               BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                                               CHUNK=1024, num_warps=4)
    return sorted_ids, expert_ids, ntpp


def moe_align_block_size_ref(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch reference of `moe_align_block_size` (pairs of one expert in pair order)."""
    flat = topk_ids.reshape(-1).long()
    m = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    unpadded_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert
    sorted_experts = flat[order]
    rank = torch.arange(m, device=device) - unpadded_start[sorted_experts]
    max_padded = _max_padded(m, block_m, num_experts)
    sorted_token_ids = torch.full((max_padded,), m, dtype=torch.int32, device=device)
    sorted_token_ids.scatter_(0, padded_start[sorted_experts] + rank, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_token_ids, expert_ids.to(torch.int32), padded_end[-1:].to(torch.int32)
