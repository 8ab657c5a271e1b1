"""Softmax top-k routing in one Triton program per token (vLLM's fused `topk_softmax`): the plain
routing of Mixtral, Qwen2/3-MoE and DeepSeek-V2-Lite (softmax over the experts, the top_k best,
optional renormalisation and scaling) as one launch instead of ~8 torch ops per MoE layer.

    logits [2, 1, 0, 1], top_k 2, renormalize: p [.47, .17, .06, .17] -> ids [0, 1] (ties: the lower
    index, as torch.topk), weights [.47, .17] / .64 = [.73, .27]

With num_shared > 0 (DeepSeek's shared experts stacked after the routed ones, layers/fused_moe/layer.py)
each row gets num_shared more columns: ids num_experts .. num_experts + num_shared - 1, weight 1.0
(neither renormalised nor scaled), so the fused MoE runs the shared experts with the routed ones.

Grouped or sigmoid routing (DeepSeek-V2 / V3) stays on the torch path of
`pagedllm.layers.fused_moe.router.select_experts`, which is also this kernel's reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,  # (T, E), any float dtype, row stride stride_t
    weights_ptr,  # float32 (T, TOP_K) out
    ids_ptr,  # int32 (T, TOP_K) out
    num_experts,
    stride_t,
    scale,  # routed_scaling_factor
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    NUM_SHARED: tl.constexpr = 0,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + row * stride_t + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(valid, p, -1.0)  # the experts not yet picked (probabilities are >= 0)
    slots = tl.arange(0, TOP_K_PAD)
    vals = tl.zeros([TOP_K_PAD], tl.float32)
    ids = tl.zeros([TOP_K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, offs, BLOCK_E), 0)  # the lowest index among equal scores
        vals = tl.where(slots == k, best, vals)
        ids = tl.where(slots == k, idx, ids)
        left = tl.where(offs == idx, -2.0, left)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(slots < TOP_K, vals, 0.0), 0)
    out = row * (TOP_K + NUM_SHARED) + slots
    tl.store(weights_ptr + out, vals * scale, mask=slots < TOP_K)
    tl.store(ids_ptr + out, ids, mask=slots < TOP_K)
    for j in tl.static_range(NUM_SHARED):
        tl.store(weights_ptr + row * (TOP_K + NUM_SHARED) + TOP_K + j, 1.0)
        tl.store(ids_ptr + row * (TOP_K + NUM_SHARED) + TOP_K + j, num_experts + j)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 routed_scaling_factor: float = 1.0, num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) logits -> (weights float32 (T, top_k + num_shared), ids int32 (T, top_k + num_shared)),
    routed ids best first, then the shared experts E .. E + num_shared - 1 at weight 1."""
    t, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty((t, top_k + num_shared), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k + num_shared), dtype=torch.int32, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](
            router_logits, weights, ids, e, router_logits.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), BLOCK_E=triton.next_power_of_2(e),
            RENORMALIZE=bool(renormalize and top_k > 1), NUM_SHARED=num_shared, num_warps=1 if e <= 128 else 2,
        )
    return weights, ids


@triton.jit
def _router_topk_softmax_kernel(
    x_ptr,  # (T, K) hidden states, row stride stride_x
    w_ptr,  # (E, K) the router's weight, row stride stride_w
    weights_ptr,  # float32 (T, TOP_K) out
    ids_ptr,  # int32 (T, TOP_K) out
    num_tokens,
    num_experts,
    K,
    stride_x,
    stride_w,
    scale,  # routed_scaling_factor
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    """`topk_softmax` of the router GEMM's logits, the GEMM in the same program: BLOCK_T tokens x
    every expert per program. The logits are rounded to x's dtype before the softmax, as the
    separate GEMM stores them."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < num_tokens
    offs_e = tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[None, :].to(tl.int64) * stride_w + offs_k[:, None]  # (BLOCK_K, BLOCK_E)
    acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        x = tl.load(x_ptrs, mask=t_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & e_mask[None, :], other=0.0)
        if x_ptr.dtype.element_ty == tl.float32:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
    logits = tl.where(e_mask[None, :], logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    left = tl.where(e_mask[None, :], p, -1.0)  # (BLOCK_T, BLOCK_E): the experts not yet picked
    slots = tl.arange(0, TOP_K_PAD)
    vals = tl.zeros([BLOCK_T, TOP_K_PAD], tl.float32)
    ids = tl.zeros([BLOCK_T, TOP_K_PAD], tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(left, 1)  # (BLOCK_T,)
        idx = tl.min(tl.where(left == best[:, None], offs_e[None, :], BLOCK_E), 1)  # lowest index on ties
        vals = tl.where(slots[None, :] == k, best[:, None], vals)
        ids = tl.where(slots[None, :] == k, idx[:, None], ids)
        left = tl.where(offs_e[None, :] == idx[:, None], -2.0, left)
    if RENORMALIZE:
        vals = vals / tl.sum(tl.where(slots[None, :] < TOP_K, vals, 0.0), 1)[:, None]
    out = offs_t.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = t_mask[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, vals * scale, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def router_topk_softmax(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                        routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_softmax(x @ gate_weight.T, ...) in one launch: (T, hidden) x (E, hidden) -> (weights
    float32 (T, top_k), ids int32 (T, top_k)). Opt-in (PAGEDLLM_FUSED_ROUTER=1): on the H200 at
    Qwen3-30B-A3B's shape it took 14.6 us at 256 tokens against 9.1 for cuBLAS + topk_softmax (each
    16-token program streams the whole 512 KB router weight through one SM). Reference:
    `topk_softmax(F.linear(x, gate_weight), ...)` (select_experts' torch path)."""
    t, k = x.shape
    e = gate_weight.shape[0]
    if gate_weight.shape[1] != k or x.stride(1) != 1 or gate_weight.stride(1) != 1:
        raise ValueError(f"router_topk_softmax: x {tuple(x.shape)} and gate_weight {tuple(gate_weight.shape)} "
                         "must be row-major with the same hidden size")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    if t:
        block_t = 16
        _router_topk_softmax_kernel[(triton.cdiv(t, block_t),)](
            x, gate_weight, weights, ids, t, e, k, x.stride(0), gate_weight.stride(0), float(routed_scaling_factor),
            TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=64 if x.dtype == torch.float32 else 128, RENORMALIZE=bool(renormalize and top_k > 1),
            num_warps=4, num_stages=3,
        )
    return weights, ids
