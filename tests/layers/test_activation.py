from __future__ import annotations

import torch

from pagedllm.layers.activation import SiluAndMul


def test_silu_and_mul_splits_gate_and_up():
    x = torch.tensor([[1.0, -2.0, 3.0, 4.0]])  # gate [1, -2], up [3, 4]
    sig = torch.sigmoid(torch.tensor([1.0, -2.0]))
    expected = torch.tensor([[1.0, -2.0]]) * sig * torch.tensor([[3.0, 4.0]])
    torch.testing.assert_close(SiluAndMul()(x), expected)
    assert SiluAndMul()(torch.randn(5, 3, 8)).shape == (5, 3, 4)
