"""Top-k expert selection: which experts each token goes to, and with what weight.

    softmax (Mixtral, Qwen2/3-MoE, DeepSeek-V2):  p = softmax(logits); top-k of p; optionally p /= sum(top-k p)
    sigmoid (DeepSeek-V3):                         s = sigmoid(logits); experts are picked on s + bias
                                                   (e_score_correction_bias), weighted by s itself
    grouped (DeepSeek "group_limited_greedy" / "noaux_tc"): experts are split into num_expert_group
        groups; only the topk_group best groups (by their max score, or by the sum of their two best
        biased scores for sigmoid) may be picked from.
    routed_scaling_factor multiplies the final weights (DeepSeek).
    num_fused_shared_experts S appends S columns to every row: experts E .. E + S - 1 (DeepSeek's
        shared experts stacked after the routed ones) at weight 1.0, not renormalised nor scaled.

Worked example, 4 experts, top_k 2, softmax, renormalize: logits [2, 1, 0, 1] -> p [.47, .17, .06, .17]
-> ids [0, 1] (ties keep the lower index, as torch.topk), weights [.47, .17] / .64 = [.73, .27].
Weights are float32 (T, top_k); ids int32 (T, top_k). On CUDA the plain softmax case runs as one
Triton program per token (kernels/moe_router.py), checked against the torch code here.
"""

from __future__ import annotations

import torch

SCORING_FUNCS = ("softmax", "sigmoid")


def select_experts(
    router_logits: torch.Tensor,  # (T, num_experts)
    top_k: int,
    renormalize: bool,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,  # (num_experts,), sigmoid routing only
    routed_scaling_factor: float = 1.0,
    num_fused_shared_experts: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (topk_weights float32 (T, top_k + S), topk_ids int32 (T, top_k + S)), S = num_fused_shared_experts."""
    num_experts = router_logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
    plain = scoring_func == "softmax" and e_score_correction_bias is None and (num_expert_group or 1) <= 1
    if plain and router_logits.is_cuda:  # one fused launch (kernels/moe_router.py); this function is its reference
        from pagedllm.kernels.moe_router import topk_softmax

        return topk_softmax(router_logits, top_k, renormalize, routed_scaling_factor, num_fused_shared_experts)
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"scoring_func {scoring_func!r} is not supported; supported: {list(SCORING_FUNCS)}")
    # What experts are ranked by; the weights always come from `scores`.
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    if num_expert_group is not None and num_expert_group > 1:
        choice = _mask_to_best_groups(choice, num_expert_group, topk_group or num_expert_group,
                                      by_top2_sum=e_score_correction_bias is not None)
    topk_ids = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize and top_k > 1:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + (1e-20 if scoring_func == "sigmoid"
                                                                                  else 0.0))
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    topk_ids = topk_ids.to(torch.int32)
    if num_fused_shared_experts:
        t, s = topk_ids.shape[0], num_fused_shared_experts
        shared = torch.arange(num_experts, num_experts + s, dtype=torch.int32, device=topk_ids.device)
        topk_ids = torch.cat([topk_ids, shared.expand(t, s)], 1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_ones(t, s)], 1)
    return topk_weights, topk_ids


def _mask_to_best_groups(choice: torch.Tensor, num_groups: int, topk_group: int, by_top2_sum: bool) -> torch.Tensor:
    """Scores of experts outside the topk_group best groups set to 0 (scores here are >= 0, the
    bias may make them negative, so the masked value is -inf for the biased case)."""
    t, e = choice.shape
    if e % num_groups:
        raise ValueError(f"n_routed_experts {e} is not divisible by n_group {num_groups}")
    grouped = choice.view(t, num_groups, e // num_groups)
    if by_top2_sum:  # DeepSeek-V3 noaux_tc: a group's score is the sum of its two best experts
        group_scores = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(dim=-1)
    else:  # DeepSeek-V2 group_limited_greedy: a group's score is its best expert
        group_scores = grouped.max(dim=-1).values
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices  # (T, topk_group)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    fill = float("-inf") if by_top2_sum else 0.0
    return grouped.masked_fill(~keep[..., None], fill).view(t, e)
