"""The fused softmax top-k router (interpreter on CPU) equals the torch routing it replaces on CUDA."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.moe_router import topk_softmax
from pagedllm.layers.fused_moe.router import select_experts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("t, e, top_k, renormalize, scale", [
    (33, 128, 8, True, 1.0),   # Qwen3-30B-A3B
    (7, 64, 6, False, 1.0),    # DeepSeek-V2-Lite
    (4, 60, 4, False, 2.5),    # Qwen2-MoE-like, not a power of two, routed scaling
    (3, 8, 1, True, 1.0),
])
def test_topk_softmax_matches_torch_routing(t, e, top_k, renormalize, scale):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(e)).to(DEVICE)
    weights, ids = topk_softmax(logits, top_k, renormalize, scale)
    ref_w, ref_ids = select_experts(logits.cpu(), top_k, renormalize, routed_scaling_factor=scale)
    assert ids.cpu().equal(ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)


def test_ties_pick_the_lower_index():
    weights, ids = topk_softmax(torch.tensor([[2.0, 1.0, 0.0, 1.0]], device=DEVICE), 2, True)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights.cpu(), torch.tensor([[0.7311, 0.2689]]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("renormalize, scale", [(False, 1.0), (True, 2.5)])
def test_fused_shared_experts_are_appended_at_weight_one(renormalize, scale):
    # DeepSeek's shared experts stacked after the 64 routed ones: ids 64, 65 at weight 1 (not scaled).
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    weights, ids = topk_softmax(logits, 6, renormalize, scale, num_shared=2)
    ref_w, ref_ids = select_experts(logits.cpu(), 6, renormalize, routed_scaling_factor=scale,
                                    num_fused_shared_experts=2)
    plain_w, plain_ids = select_experts(logits.cpu(), 6, renormalize, routed_scaling_factor=scale)
    assert ids.shape == (5, 8) and ids.cpu().equal(ref_ids)
    assert ref_ids[:, :6].equal(plain_ids) and (ref_ids[:, 6:] == torch.tensor([64, 65], dtype=torch.int32)).all()
    assert ref_w[:, :6].equal(plain_w) and (ref_w[:, 6:] == 1.0).all()
    torch.testing.assert_close(weights.cpu(), ref_w, atol=1e-6, rtol=1e-5)
