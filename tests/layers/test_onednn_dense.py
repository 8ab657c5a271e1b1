"""The oneDNN fused dense layer against its plain torch reference (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.layers.onednn_dense import OneDNNDense, dense_ref, onednn_available


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("act", [None, "gelu", "gelu_tanh"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_onednn_dense_matches_reference(act, with_residual):
    torch.manual_seed(0)
    x, w, b = torch.randn(37, 48), torch.randn(80, 48) * 0.2, torch.randn(80)
    res = torch.randn(37, 80) if with_residual else None
    got = OneDNNDense(w, b)(x, act, res)
    want = dense_ref(x, w, b, act, res)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4
    # Another row count reuses the prepared weight.
    assert (OneDNNDense(w, b)(x[:5], act) - dense_ref(x[:5], w, b, act)).abs().max() <= 1e-4
