"""Fused MoE on the GPU: the experts of a step as two grouped GEMMs, with no host sync (CUDA graphs).

    1. moe_align_block_size (one Triton program; the torch reference beside it): sort the T * top_k
       (token, slot) pairs by expert and pad each expert's run to a multiple of BLOCK_M, so every
       BLOCK_M rows of the sorted list belong to one expert.
           top_k 2, topk_ids [[2, 0], [2, 1]], BLOCK_M 4 -> pairs by expert: e0 [1], e1 [3], e2 [0, 2]
           sorted_token_ids [1, P, P, P, 3, P, P, P, 0, 2, P, P]  (P = 4 = T * top_k: padding)
           expert_ids       [0, 1, 2]   (one per BLOCK_M rows), num_tokens_post_padded [12]
    2. _fused_moe_kernel (grouped GEMM): a program takes BLOCK_M sorted rows x BLOCK_N columns and
       multiplies the rows' inputs by its expert's weight; padding rows are masked out.
           GEMM 1: x[pair // top_k] @ W13[e]^T  -> (T * top_k, 2 * inter)   [gate | up]
           SiLU-and-mul                          -> (T * top_k, inter)   (GEMM 1's epilogue for small tiles)
           GEMM 2: h[pair] @ W2[e]^T * weight    -> (T * top_k, hidden)
    3. combine: the top_k rows of each token summed -> (T, hidden).

Decode-sized steps (`_scan_config`) replace step 1 with one program per expert that lists its own
pairs (`_moe_expert_rows_kernel`: no atomics, no padding) and GEMMs that take each expert's list
(`_fused_moe_rows_kernel`): the one-program align took ~23 us at 256 tokens x 8 on the H200, 5% of a
decode step of Qwen3-30B-A3B.

Each expert's weights are read once per step however many tokens it got (the kernel's floor is the
bytes of the experts hit). The plain PyTorch reference is `pagedllm.layers.fused_moe.torch_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.envs import kernel_switches
from pagedllm.kernels.activation import silu_and_mul

try:  # host-side TMA descriptors (Triton >= 3.3); without them only the pointer kernel runs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None

__all__ = ["fused_experts", "moe_align_block_size", "moe_align_block_size_ref", "moe_align_block_size_rows", "moe_sum"]


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


@triton.jit
def _grouped_tile(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: programs in groups of GROUP_M row blocks x every
    column block, column-major inside a group, so the row blocks of one expert with many rows
    (DeepSeek's shared experts take every token) read each weight tile at about the same time: from
    DRAM once, from L2 after. Worked example, GROUP_M 2, 3 row x 2 column blocks: pids 0..5 -> (m, n)
    (0,0) (1,0) (0,1) (1,1) (2,0) (2,1)."""
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _store_expert_tile(acc, acc_up, c_ptr, topk_weights_ptr, pair, valid, offs_n, n_mask, stride_cm,
                       FUSE_SILU: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr):
    """The grouped GEMMs' epilogue: c[pair, offs_n] = silu(gate) * up (FUSE_SILU; else acc) x the
    routed weight (MUL_ROUTED_WEIGHT). gate and up are rounded to the output dtype first, as the
    unfused path stores [gate | up] before silu_and_mul (kernels/activation.py): the same values,
    one launch and buffer fewer."""
    out = acc
    if FUSE_SILU:
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        up = acc_up.to(c_ptr.dtype.element_ty).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
    if MUL_ROUTED_WEIGHT:
        out = out * tl.load(topk_weights_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None] * stride_cm + offs_n[None, :], out.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _rows_gemm(
    a_ptr, b_ptr, c_ptr, topk_weights_ptr,
    pair,  # int64 (BLOCK_M,): the (token, slot) pairs of these rows, all routed to `expert`
    valid,  # (BLOCK_M,): rows that hold a pair
    expert,  # int64
    pid_n, N, K, stride_am, stride_be, stride_bn, stride_cm,
    TOP_K: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FUSE_SILU: tl.constexpr,
):
    """c[pair, n-block] = a[pair // TOP_K] @ b[expert, n-block]^T (the grouped GEMM's one tile), with
    SiLU-and-mul of the gate and up columns (FUSE_SILU) and the routed weight (MUL_ROUTED_WEIGHT)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # FUSE_SILU only: the up rows' columns
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if FUSE_SILU:  # the same columns of the up half: weight rows N + offs_n
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE_FP32:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    _store_expert_tile(acc, acc_up, c_ptr, topk_weights_ptr, pair, valid, offs_n, n_mask, stride_cm, FUSE_SILU,
                       MUL_ROUTED_WEIGHT)


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # (rows, K): x (GEMM 1, row = pair // TOP_K) or h (GEMM 2, row = pair)
    b_ptr,  # (E, N, K) expert weights
    c_ptr,  # (T * top_k, N)
    topk_weights_ptr,  # (T * top_k,) float32
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_valid_pairs,
    num_m_blocks,
    num_n_blocks,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,  # fp32 weights: exact fp32 products (no TF32), as the reference
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSE_SILU: tl.constexpr = False,  # GEMM 1 with SiLU-and-mul: c = silu(gate) * up, N = inter
    GROUP_M: tl.constexpr = 8,
):
    # Programs in groups of GROUP_M row blocks (_grouped_tile): an expert's row blocks share weight tiles in L2.
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # beyond the last expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    _rows_gemm(a_ptr, b_ptr, c_ptr, topk_weights_ptr, pair, pair < num_valid_pairs, expert, pid_n, N, K,
               stride_am, stride_be, stride_bn, stride_cm, TOP_K, MUL_ROUTED_WEIGHT, IEEE_FP32,
               BLOCK_M, BLOCK_N, BLOCK_K, FUSE_SILU)


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
def _fused_moe_rows_kernel(
    a_ptr,  # as _fused_moe_kernel
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    rows_ptr,  # int32 (E, max_rows): _moe_expert_rows_kernel's lists
    counts_ptr,  # int32 (E,)
    N,
    K,
    num_n_blocks,
    max_rows,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSE_SILU: tl.constexpr,
    NUM_SHARED: tl.constexpr = 0,  # shared experts (every token), stacked after the num_routed listed ones
    num_routed=0,
    num_tokens=0,
    pairs_per_token=1,  # top_k + NUM_SHARED: token i's pair for shared expert j is i * pairs_per_token + top_k + j
):
    """The grouped GEMM over per-expert row lists: program (expert, column block) takes its
    expert's pairs BLOCK_M at a time. One flat loop over (row block, K tile), the epilogue at each
    row block's last K tile (the shape of Triton's persistent matmul), so the loads stay pipelined;
    an expert with more pairs than BLOCK_M (rare: `_scan_config`) reads its weights again.

    Shared experts (NUM_SHARED > 0, DeepSeek's) take every token, so they have no list: their
    programs come first, one per (shared expert, column block, BLOCK_M tokens), the token chunks of
    one column block adjacent, so they read that weight tile at about the same time (DRAM once, L2
    after) instead of one program walking all the chunks and reading it chunks times.
        NUM_SHARED 2, 3 column blocks, 40 tokens, BLOCK_M 16 -> 3 chunks: pids 0..17 shared
        (pid 4: shared expert 0, column block 1, tokens 16..31), then (routed expert, column block)."""
    pid = tl.program_id(0)
    if NUM_SHARED == 0:
        expert = pid // num_n_blocks
        pid_n = pid % num_n_blocks
        count = tl.load(counts_ptr + expert)
        is_shared = pid < 0
        row0 = 0
        slot = 0
    else:
        chunks = tl.cdiv(num_tokens, BLOCK_M)
        shared_progs = NUM_SHARED * num_n_blocks * chunks
        is_shared = pid < shared_progs
        local = pid - shared_progs  # routed programs: (expert, column block)
        s_idx = pid // (num_n_blocks * chunks)
        row0 = tl.where(is_shared, (pid % chunks) * BLOCK_M, 0)
        expert = tl.where(is_shared, num_routed + s_idx, local // num_n_blocks)
        pid_n = tl.where(is_shared, (pid // chunks) % num_n_blocks, local % num_n_blocks)
        slot = pairs_per_token - NUM_SHARED + s_idx
        count = tl.where(is_shared, tl.minimum(num_tokens - row0, BLOCK_M), tl.load(counts_ptr + expert, mask=~is_shared,
                                                                                      other=0))
    if count == 0:
        return
    list_count = tl.where(is_shared, 0, count)  # shared programs compute their pairs
    row_list = rows_ptr + expert.to(tl.int64) * max_rows
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None]
    k_tiles = tl.cdiv(K, BLOCK_K)
    ki = k_tiles - 1  # the first iteration starts row block 0
    m0 = -BLOCK_M
    valid = offs_r < 0
    pair = tl.zeros([BLOCK_M], tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # FUSE_SILU only
    for _ in range(0, tl.cdiv(count, BLOCK_M) * k_tiles):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            m0 += BLOCK_M
            valid = m0 + offs_r < count
            pair = tl.load(row_list + m0 + offs_r, mask=m0 + offs_r < list_count, other=0).to(tl.int64)
            if NUM_SHARED > 0:
                pair = tl.where(is_shared, (row0 + m0 + offs_r).to(tl.int64) * pairs_per_token + slot, pair)
        k0 = ki * BLOCK_K
        k_mask = offs_k < K - k0
        a = tl.load(a_ptr + (pair // TOP_K)[:, None] * stride_am + k0 + offs_k[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_base + k0, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if FUSE_SILU:
            b_up = tl.load(b_base + k0 + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE_FP32:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        if ki == k_tiles - 1:
            _store_expert_tile(acc, acc_up, c_ptr, topk_weights_ptr, pair, valid, offs_n, n_mask, stride_cm,
                               FUSE_SILU, MUL_ROUTED_WEIGHT)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _fused_moe_tma_kernel(
    a_ptr,  # (rows, K), as _fused_moe_kernel
    b_desc,  # TMA descriptor over the experts' weights as one (E * N_total, K) matrix, [BLOCK_N, BLOCK_K] tiles
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    N_total,  # weight rows per expert: 2 * inter for GEMM 1 (gate | up), hidden for GEMM 2
    num_valid_pairs,
    num_m_blocks,
    num_n_blocks,
    stride_am,
    stride_cm,
    TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FUSE_SILU: tl.constexpr = False,
    GROUP_M: tl.constexpr = 8,
):
    """`_fused_moe_kernel` with the weight tiles fetched by the Hopper TMA unit (the rows' inputs are
    gathered, pair // TOP_K, so they stay pointer loads). A tile of the last column block may reach
    into the next expert's rows (or past the matrix, zero-filled): those columns are computed and
    never stored. K past the weights' width is zero-filled, so only the input loads carry a K mask."""
    pid_m, pid_n = _grouped_tile(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_valid_pairs
    expert = tl.load(expert_ids_ptr + pid_m)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // TOP_K)[:, None] * stride_am + offs_k[None, :]
    row_b = expert * N_total + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptrs, mask=valid[:, None] & (offs_k < K - k0)[None, :], other=0.0)
        b = b_desc.load([row_b, k0])  # (BLOCK_N, BLOCK_K), K contiguous
        acc = tl.dot(a, tl.trans(b), acc)
        if FUSE_SILU:
            b_up = b_desc.load([row_b + N, k0])
            acc_up = tl.dot(a, tl.trans(b_up), acc_up)
        a_ptrs += BLOCK_K
    _store_expert_tile(acc, acc_up, c_ptr, topk_weights_ptr, pair, valid, offs_n, n_mask, stride_cm, FUSE_SILU,
                       MUL_ROUTED_WEIGHT)


def _config(num_pairs: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes by the step's (token, expert) pairs. 16-bit weights take the tiles that won
    scripts/moe_config_sweep.py on the H200 at Qwen3-30B-A3B's expert shape (BENCHMARKS.md, issue 24),
    close to vLLM's tuned H200 table: few rows per expert stream the weights in 128-deep K tiles
    (+10% at 1 token); big prefills take 128 x 256 tiles, 8 warps, 4 stages (+18% at 2,048 tokens).
    Decode batches take the row-list path (`_scan_config`) unless PAGEDLLM_MOE_SCAN=0 or experts are
    shared; here they keep 64 x 64 x 64 (the sweep's 32 x 256 x 128 spills registers on sm_90,
    tests/kernels/test_compile_sm90.py). fp32 (the exactness tests) keeps small tiles that fit
    shared memory."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16 if num_pairs <= 256 else 64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)
    if num_pairs <= 256:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if num_pairs <= 8192:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    if TensorDescriptor is not None:
        # Prefill sizes: SiLU in GEMM 1 (two 128 x 128 accumulators, the registers of one 128 x 256)
        # and the weight tiles by TMA. H200, 8192 tokens (h45 rounds 1 and 3): 1553.5 / 1615.8 us a
        # layer against 1668.9 / 1676.2 for 128 x 256 with SiLU apart; equal to the torch reference.
        # GEMM 2 (N = hidden, K = the intermediate size) in 256-column tiles, 3 stages: 1459.5 against
        # 1506.1 us (h49 round 1).
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4, FUSE_SILU=True, TMA=True,
                    DOWN=dict(BLOCK_N=256, num_stages=3))
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)


# GEMM 1 computes SiLU-and-mul in its epilogue (two accumulators, gate and up columns) when its tile
# is at most this many elements (the decode / mid-size tiles, 16 x 64, 64 x 64) or its config says
# FUSE_SILU (the TMA prefill tile, 128 x 128 x 2); the 128 x 256 tile keeps the separate kernel.
FUSED_SILU_MAX_TILE = 64 * 64


def down_config(cfg: dict) -> dict:
    """GEMM 2's tiles: GEMM 1's, with cfg["DOWN"]'s entries over them. The two GEMMs differ in shape
    (Qwen3-30B-A3B: GEMM 1 N = 2 x 768 over K = 2048, GEMM 2 N = 2048 over K = 768), so a tile that
    streams one's weights well may not suit the other. BLOCK_M stays GEMM 1's: the sorted rows
    are padded to it.
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "DOWN": {"BLOCK_N": 128}}
            -> {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}"""
    down = cfg.get("DOWN")
    if not down:
        return cfg
    if "BLOCK_M" in down and down["BLOCK_M"] != cfg["BLOCK_M"]:
        raise ValueError(f"fused_experts: DOWN's BLOCK_M {down['BLOCK_M']} must equal BLOCK_M {cfg['BLOCK_M']} "
                         "(the sorted rows are padded to it)")
    return {k: v for k, v in {**cfg, **down}.items() if k not in ("DOWN", "FUSE_SILU")}


def _grouped_gemm(a, w, out, topk_weights, sorted_ids, expert_ids, ntpp, top_k, mul_weight, cfg,
                  fuse_silu: bool = False) -> None:
    n, k = w.shape[1] // (2 if fuse_silu else 1), w.shape[2]
    num_m_blocks, num_n_blocks = triton.cdiv(sorted_ids.numel(), cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"])
    grid = (num_m_blocks * num_n_blocks,)
    if cfg.get("TMA"):
        if TensorDescriptor is None or w.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError("fused_experts: TMA tiles need Triton's TensorDescriptor and 16-bit weights")
        e, n_total = w.shape[0], w.shape[1]
        desc = TensorDescriptor(w.view(e * n_total, k), [e * n_total, k], [k, 1], [cfg["BLOCK_N"], cfg["BLOCK_K"]])
        _fused_moe_tma_kernel[grid](
            a, desc, out, topk_weights, sorted_ids, expert_ids, ntpp, n, k, n_total, out.shape[0], num_m_blocks,
            num_n_blocks, a.stride(0), out.stride(0),
            TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_weight, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"], FUSE_SILU=fuse_silu, GROUP_M=cfg.get("GROUP_M", 8),
            num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
        )
        return
    _fused_moe_kernel[grid](
        a, w, out, topk_weights, sorted_ids, expert_ids, ntpp, n, k, out.shape[0], num_m_blocks, num_n_blocks,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_weight, IEEE_FP32=w.dtype == torch.float32,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], FUSE_SILU=fuse_silu,
        GROUP_M=cfg.get("GROUP_M", 8),
        num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3),
    )


@triton.jit
def _moe_sum_kernel(
    x_ptr,  # (T, TOP_K, hidden), rows contiguous
    out_ptr,  # (T, hidden)
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = sum over the top_k rows of x[t], in fp32, rounded once (as torch's sum of a 16-bit
    tensor)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + k) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(down: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T * top_k, hidden) -> (T, hidden): each token's top_k expert outputs summed. One program per
    (token, 1024 columns): torch's strided reduction over dim 1 ran at ~1.3 TB/s on the H200 at
    decode sizes (7 us a layer at 256 tokens x 8 x 2048). Reference: `down.view(T, top_k, -1).sum(1)`."""
    rows, hidden = down.shape
    t = rows // top_k
    if down.stride(1) != 1 or down.stride(0) != hidden:
        return down.view(t, top_k, hidden).sum(dim=1)
    out = torch.empty((t, hidden), dtype=down.dtype, device=down.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(t, triton.cdiv(hidden, block))](down, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out


# Read once at import: PAGEDLLM_MOE_SCAN=0 sends decode batches through the align step as well;
# PAGEDLLM_MOE_SCAN_SHARED=1 lets blocks with shared experts (DeepSeek) take the row lists too.
_SCAN_ENABLED = kernel_switches().moe_scan
_SCAN_SHARED = _SCAN_ENABLED and kernel_switches().moe_scan_shared
# PAGEDLLM_MOE_ALIGN_ROWS=1: steps past ALIGN_KERNEL_MAX_PAIRS sort their pairs with `moe_align_block_size_rows`.
_ALIGN_ROWS = kernel_switches().moe_align_rows
# The row-list path takes steps of at most this many pairs (Qwen3-30B-A3B: 512 tokens x 8) and at
# most SCAN_MAX_MEAN_ROWS pairs per expert on average: each list program reads every expert id of
# the step, and an expert with more pairs than BLOCK_M reads its weights once per extra row block.
SCAN_MAX_PAIRS = 4096
SCAN_MAX_MEAN_ROWS = 16


def _scan_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict | None:
    """Tiles of the row-list path (`_fused_moe_rows_kernel`), or None where it does not apply.
    BLOCK_M covers nearly every expert's pairs under uniform routing (mean m, sd ~ sqrt(m)), so its
    weights are read once: mean <= 8 -> 16 rows, else 32 (Qwen3-30B-A3B: up to 128 tokens -> 16,
    up to 256 -> 32). GEMM 1 streams 2 x 64 weight rows (gate, up) 128 deep per program; GEMM 2 128
    rows (its K is only the intermediate size, so wider programs are fewer and longer). On the H200
    (h45 round 3, CUDA-graph replays over 8 layers' experts, row lists + both GEMMs + sum): 256 tokens
    307.7 us a layer (92% of the experts' bytes) against the align path's 331.4, 64-row lists 332.3;
    128 tokens 290.6 us (97%) against 316.0."""
    mean = num_pairs / num_experts
    if not _SCAN_ENABLED or num_pairs > SCAN_MAX_PAIRS or mean > SCAN_MAX_MEAN_ROWS:
        return None
    block_m = 16 if mean <= 8 else 32
    if dtype == torch.float32:  # the exactness tests: tiles that fit shared memory in fp32
        return dict(SCAN=True, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2,
                    DOWN=dict(BLOCK_N=32))
    return dict(SCAN=True, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3,
                DOWN=dict(BLOCK_N=128))


def _fused_experts_scan(x, w13, w2, weights, topk_ids, cfg: dict, shared: int = 0) -> torch.Tensor:
    """fused_experts without the sorted list: each expert's row list (`_moe_expert_rows_kernel`,
    one program per routed expert), GEMM 1 (+ SiLU) and GEMM 2 over the lists -> (T * top_k, hidden).
    shared: the last `shared` experts take every token (no lists: their programs compute the pairs)."""
    t, top_k = topk_ids.shape
    e, two_inter, hidden = w13.shape
    inter = two_inter // 2
    routed = e - shared
    ids = topk_ids.reshape(-1)
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        ids = ids.to(torch.int32).contiguous()
    rows = torch.empty((e, t), dtype=torch.int32, device=x.device)  # an expert takes a token at most once
    counts = torch.empty(e, dtype=torch.int32, device=x.device)
    _moe_expert_rows_kernel[(routed,)](ids, rows, counts, t * top_k, t,
                                       CHUNK=max(16, min(1024, triton.next_power_of_2(t * top_k))), num_warps=4)
    h = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    down = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    fp32 = w13.dtype == torch.float32
    for a, w, out, n, k, tk, first, gemm in ((x, w13, h, inter, hidden, top_k, True, cfg),
                                              (h, w2, down, hidden, inter, 1, False, down_config(cfg))):
        n_blocks = triton.cdiv(n, gemm["BLOCK_N"])
        shared_progs = shared * n_blocks * triton.cdiv(t, gemm["BLOCK_M"])
        _fused_moe_rows_kernel[(routed * n_blocks + shared_progs,)](
            a, w, out, weights, rows, counts, n, k, n_blocks, t, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            TOP_K=tk, MUL_ROUTED_WEIGHT=not first, IEEE_FP32=fp32, BLOCK_M=gemm["BLOCK_M"], BLOCK_N=gemm["BLOCK_N"],
            BLOCK_K=gemm["BLOCK_K"], FUSE_SILU=first, NUM_SHARED=shared, num_routed=routed, num_tokens=t,
            pairs_per_token=top_k, num_warps=gemm["num_warps"], num_stages=gemm.get("num_stages", 3),
        )
    return down


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
) -> torch.Tensor:  # (T, hidden), or (T, top_k, hidden) with sum_topk=False
    t, top_k = topk_ids.shape
    e, two_inter, hidden = w13.shape
    if x.shape != (t, hidden) or w2.shape != (e, hidden, two_inter // 2):
        raise ValueError(f"fused_experts: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"and topk_ids {tuple(topk_ids.shape)} do not agree")
    if not (x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()):
        raise ValueError("fused_experts needs row-major x and contiguous expert weights")
    if t == 0:
        return torch.zeros_like(x) if sum_topk else x.new_zeros((0, top_k, hidden))
    if config is None and shared_experts and _SCAN_SHARED:  # the routed experts' pairs pick the row-list tiles
        config = _scan_config(t * (top_k - shared_experts), e - shared_experts, w13.dtype)
    cfg = config or (None if shared_experts else _scan_config(t * top_k, e, w13.dtype)) or _config(t * top_k, w13.dtype)
    weights = topk_weights.reshape(-1).float().contiguous()
    if cfg.get("SCAN"):
        down = _fused_experts_scan(x, w13, w2, weights, topk_ids, cfg, shared_experts)
        return moe_sum(down, top_k) if sum_topk else down.view(t, top_k, hidden)
    sorted_ids, expert_ids, ntpp = moe_align_block_size(topk_ids, cfg["BLOCK_M"], e)
    if cfg.get("FUSE_SILU", cfg["BLOCK_M"] * cfg["BLOCK_N"] <= FUSED_SILU_MAX_TILE):
        h = torch.empty((t * top_k, two_inter // 2), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, h, weights, sorted_ids, expert_ids, ntpp, top_k, False, cfg, fuse_silu=True)
    else:
        gate_up = torch.empty((t * top_k, two_inter), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, gate_up, weights, sorted_ids, expert_ids, ntpp, top_k, False, cfg)
        h = silu_and_mul(gate_up)  # (T * top_k, inter)
    down = torch.empty((t * top_k, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(h, w2, down, weights, sorted_ids, expert_ids, ntpp, 1, True, down_config(cfg))
    return moe_sum(down, top_k) if sum_topk else down.view(t, top_k, hidden)
