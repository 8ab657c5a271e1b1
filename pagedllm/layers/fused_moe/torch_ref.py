"""Plain PyTorch experts: the CPU path and the reference the fused Triton kernel must match.

For each expert that got at least one token: gather its tokens, [gate | up] = x W13[e]^T,
h = silu(gate) * up, y = h W2[e]^T, scale by the token's routing weight and add into the output row.
Only experts that were picked are computed (a loop over the experts hit, with one host sync for the
list), which is what a CPU wants; the GPU path (`pagedllm.kernels.fused_moe`) has no host sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_ref(
    x: torch.Tensor,  # (T, hidden)
    w13: torch.Tensor,  # (E, 2 * inter, hidden): [gate; up] of every expert
    w2: torch.Tensor,  # (E, hidden, inter)
    topk_weights: torch.Tensor,  # (T, top_k) float32
    topk_ids: torch.Tensor,  # (T, top_k) int
) -> torch.Tensor:  # (T, hidden) in x's dtype
    t, top_k = topk_ids.shape
    out = torch.zeros((t, w2.shape[1]), dtype=torch.float32, device=x.device)
    if t == 0:
        return out.to(x.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    # Group the (token, slot) pairs by expert: one sort instead of a mask per expert.
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tokens[start : start + n]
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        # A token picks an expert at most once, so `rows` has no repeats: a plain indexed add will do
        # (index_add_ was ~10x slower on a busy 2-core CPU, its parallel scatter waiting on threads).
        out[rows] += y.float() * weights[start : start + n, None]
        start += n
    return out.to(x.dtype)
