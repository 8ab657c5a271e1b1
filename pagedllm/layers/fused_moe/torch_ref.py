"""Plain PyTorch experts: the CPU path and the reference the fused Triton kernel must match.

For each expert that got at least one token: gather its tokens, [gate | up] = x W13[e]^T,
h = silu(gate) * up, y = h W2[e]^T, scale by the token's routing weight and add into the output row.
Only experts that were picked are computed (a loop over the experts hit, with one host sync for the
list), which is what a CPU wants; the GPU path (`pagedllm.kernels.fused_moe`) has no host sync.
FP8 experts (w13_scale / w2_scale, quantization/fp8_moe.py): each expert hit is dequantized first.
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
    w13_scale: torch.Tensor | None = None,  # (E,) float32: FP8 experts (float8_e4m3fn w13 / w2), one
    w2_scale: torch.Tensor | None = None,  # scale per expert and GEMM; each expert hit is dequantized
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
        gate, up = F.linear(x[rows], _dequant(w13[e], w13_scale, e, x.dtype)).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, _dequant(w2[e], w2_scale, e, x.dtype))
        # A token picks an expert at most once, so `rows` has no repeats: a plain indexed add will do
        # (index_add_ was ~10x slower on a busy 2-core CPU, its parallel scatter waiting on threads).
        out[rows] += y.float() * weights[start : start + n, None]
        start += n
    return out.to(x.dtype)


def _dequant(w: torch.Tensor, scale: torch.Tensor | None, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert e's weight in the compute dtype: as stored, or fp8 x its scale (in fp32, then rounded to
    `dtype`: in fp32 exactly the weights `transformers` gets from a dequantized checkpoint)."""
    if scale is None:
        return w
    return (w.float() * scale[e].float()).to(dtype)
