"""The grouped GEMMs of fused MoE over moe_align_block_size's sorted list (kernels/moe_align.py).

A program takes BLOCK_M sorted rows x BLOCK_N columns and multiplies the rows' inputs by its
expert's weight; padding rows are masked out:
    GEMM 1: x[pair // top_k] @ W13[e]^T  -> (T * top_k, 2 * inter)   [gate | up]
    SiLU-and-mul                          -> (T * top_k, inter)   (GEMM 1's epilogue for small tiles)
    GEMM 2: h[pair] @ W2[e]^T * weight    -> (T * top_k, hidden)
Two kernels: weight tiles by pointer loads (`_fused_moe_kernel`) or by the Hopper TMA unit
(`_fused_moe_tma_kernel`, prefill tiles). Each expert's weights are read once per step however many
tokens it got. The plain PyTorch reference is `pagedllm.layers.fused_moe.torch_ref.fused_experts_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.kernels.tile_order import grouped_tile

try:  # host-side TMA descriptors (Triton >= 3.3); without them only the pointer kernel runs
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


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
    b_scale_ptr=None, W_SCALED: tl.constexpr = False,
):
    """c[pair, n-block] = a[pair // TOP_K] @ b[expert, n-block]^T (the grouped GEMM's one tile), with
    SiLU-and-mul of the gate and up columns (FUSE_SILU) and the routed weight (MUL_ROUTED_WEIGHT).
    W_SCALED (FP8 experts, W8A16): b holds float8_e4m3fn tiles, converted to a's dtype for the dot
    (exact: every e4m3 value is a bf16 / fp16 / fp32 value) and the accumulators multiplied by the
    expert's scale b_scale_ptr[expert] before the epilogue (before SiLU: the scale is the weights')."""
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
        if W_SCALED:
            b = b.to(a.dtype)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        if FUSE_SILU:  # the same columns of the up half: weight rows N + offs_n
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if W_SCALED:
                b_up = b_up.to(a.dtype)
            if IEEE_FP32:
                acc_up = tl.dot(a, b_up, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, b_up, acc_up)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if W_SCALED:  # one scale per expert: gate and up share it (quantization/fp8_moe.py requantizes them)
        w_scale = tl.load(b_scale_ptr + expert)
        acc = acc * w_scale
        acc_up = acc_up * w_scale
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
    b_scale_ptr=None,  # W_SCALED only: (E,) float32 per-expert weight scales (None: a constexpr, no argument)
    W_SCALED: tl.constexpr = False,  # FP8 experts (W8A16): fp8 weight tiles x the expert's scale
):
    # Programs in groups of GROUP_M row blocks (grouped_tile): an expert's row blocks share weight tiles in L2.
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return  # beyond the last expert's padded run
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    _rows_gemm(a_ptr, b_ptr, c_ptr, topk_weights_ptr, pair, pair < num_valid_pairs, expert, pid_n, N, K,
               stride_am, stride_be, stride_bn, stride_cm, TOP_K, MUL_ROUTED_WEIGHT, IEEE_FP32,
               BLOCK_M, BLOCK_N, BLOCK_K, FUSE_SILU, b_scale_ptr, W_SCALED)


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
    pid_m, pid_n = grouped_tile(tl.program_id(0), num_m_blocks, num_n_blocks, GROUP_M)
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
                  fuse_silu: bool = False, w_scale: torch.Tensor | None = None) -> None:
    """w_scale (E,) float32 with float8_e4m3fn `w`: the FP8 experts' variant (W_SCALED), pointer kernel only."""
    n, k = w.shape[1] // (2 if fuse_silu else 1), w.shape[2]
    num_m_blocks, num_n_blocks = triton.cdiv(sorted_ids.numel(), cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"])
    grid = (num_m_blocks * num_n_blocks,)
    if cfg.get("TMA"):
        if TensorDescriptor is None or w.dtype not in (torch.bfloat16, torch.float16) or w_scale is not None:
            raise ValueError("fused_experts: TMA tiles need Triton's TensorDescriptor and 16-bit weights "
                             "(FP8 experts take the pointer kernel)")
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
    if w_scale is not None:  # FP8 experts: the W_SCALED variant; fp32 activations keep exact fp32 products
        _fused_moe_kernel[grid](
            a, w, out, topk_weights, sorted_ids, expert_ids, ntpp, n, k, out.shape[0], num_m_blocks, num_n_blocks,
            a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            TOP_K=top_k, MUL_ROUTED_WEIGHT=mul_weight, IEEE_FP32=a.dtype == torch.float32,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], FUSE_SILU=fuse_silu,
            GROUP_M=cfg.get("GROUP_M", 8), b_scale_ptr=w_scale, W_SCALED=True,
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
