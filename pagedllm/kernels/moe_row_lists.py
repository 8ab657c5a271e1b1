"""The row-list path of fused MoE for decode-sized steps: grouped GEMMs over per-expert row lists.

Decode-sized steps (`_scan_config`) replace the sorted list with one program per expert that lists
its own pairs (kernels/moe_align.py `_moe_expert_rows_kernel`: no atomics, no padding) and GEMMs that
take each expert's list (`_fused_moe_rows_kernel`): the one-program align took ~23 us at 256 tokens
x 8 on the H200, 5% of a decode step of Qwen3-30B-A3B. The plain PyTorch reference is
`pagedllm.layers.fused_moe.torch_ref.fused_experts_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.envs import kernel_switches
from pagedllm.kernels.moe_align import _moe_expert_rows_kernel
from pagedllm.kernels.moe_grouped_gemm import _store_expert_tile, down_config

# Read once at import: PAGEDLLM_MOE_SCAN=0 sends decode batches through the align step as well.
_SCAN_ENABLED = kernel_switches().moe_scan
# The row-list path takes steps of at most this many pairs (Qwen3-30B-A3B: 512 tokens x 8) and at
# most SCAN_MAX_MEAN_ROWS pairs per expert on average: each list program reads every expert id of
# the step, and an expert with more pairs than BLOCK_M reads its weights once per extra row block.
SCAN_MAX_PAIRS = 4096
SCAN_MAX_MEAN_ROWS = 16


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
    b_scale_ptr=None,  # W_SCALED only: (E,) float32 per-expert weight scales
    W_SCALED: tl.constexpr = False,  # FP8 experts (W8A16), as moe_grouped_gemm._rows_gemm
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
    if W_SCALED:
        w_scale = tl.load(b_scale_ptr + expert)
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
        if W_SCALED:  # fp8 tiles -> the activations' dtype (exact), the scale on the accumulators below
            b = b.to(a.dtype)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if FUSE_SILU:
            b_up = tl.load(b_base + k0 + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if W_SCALED:
                b_up = b_up.to(a.dtype)
            if IEEE_FP32:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        if ki == k_tiles - 1:
            if W_SCALED:
                acc = acc * w_scale
                acc_up = acc_up * w_scale
            _store_expert_tile(acc, acc_up, c_ptr, topk_weights_ptr, pair, valid, offs_n, n_mask, stride_cm,
                               FUSE_SILU, MUL_ROUTED_WEIGHT)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


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


def _fused_experts_scan(x, w13, w2, weights, topk_ids, cfg: dict, shared: int = 0,
                        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fused_experts without the sorted list: each expert's row list (`_moe_expert_rows_kernel`,
    one program per routed expert), GEMM 1 (+ SiLU) and GEMM 2 over the lists -> (T * top_k, hidden).
    shared: the last `shared` experts take every token (no lists: their programs compute the pairs).
    w13_scale / w2_scale (E,) float32: FP8 experts (the kernel's W_SCALED variant)."""
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
    for a, w, out, n, k, tk, first, gemm, scale in ((x, w13, h, inter, hidden, top_k, True, cfg, w13_scale),
                                                     (h, w2, down, hidden, inter, 1, False, down_config(cfg), w2_scale)):
        n_blocks = triton.cdiv(n, gemm["BLOCK_N"])
        shared_progs = shared * n_blocks * triton.cdiv(t, gemm["BLOCK_M"])
        grid = (routed * n_blocks + shared_progs,)
        if scale is not None:  # FP8 experts: fp32 activations keep exact fp32 products
            _fused_moe_rows_kernel[grid](
                a, w, out, weights, rows, counts, n, k, n_blocks, t, a.stride(0), w.stride(0), w.stride(1),
                out.stride(0), TOP_K=tk, MUL_ROUTED_WEIGHT=not first, IEEE_FP32=x.dtype == torch.float32,
                BLOCK_M=gemm["BLOCK_M"], BLOCK_N=gemm["BLOCK_N"], BLOCK_K=gemm["BLOCK_K"], FUSE_SILU=first,
                NUM_SHARED=shared, num_routed=routed, num_tokens=t, pairs_per_token=top_k, b_scale_ptr=scale,
                W_SCALED=True, num_warps=gemm["num_warps"], num_stages=gemm.get("num_stages", 3),
            )
            continue
        _fused_moe_rows_kernel[grid](
            a, w, out, weights, rows, counts, n, k, n_blocks, t, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            TOP_K=tk, MUL_ROUTED_WEIGHT=not first, IEEE_FP32=fp32, BLOCK_M=gemm["BLOCK_M"], BLOCK_N=gemm["BLOCK_N"],
            BLOCK_K=gemm["BLOCK_K"], FUSE_SILU=first, NUM_SHARED=shared, num_routed=routed, num_tokens=t,
            pairs_per_token=top_k, num_warps=gemm["num_warps"], num_stages=gemm.get("num_stages", 3),
        )
    return down
