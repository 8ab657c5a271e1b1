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
