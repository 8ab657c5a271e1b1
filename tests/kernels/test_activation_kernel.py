"""silu_and_mul kernel against its reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.kernels.activation import silu_and_mul, silu_and_mul_ref


@pytest.mark.parametrize("shape", [(7, 160), (2, 3, 3000)])  # the second spans two 1024-column blocks
def test_matches_reference(device, shape):
    x = torch.randn(shape, device=device) * 4
    out = silu_and_mul(x)
    inter = shape[-1] // 2
    assert out.shape == (*shape[:-1], inter)
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, F.silu(x[..., :inter]) * x[..., inter:], atol=1e-5, rtol=1e-5)


def test_half(device):
    x = torch.randn(4, 64, device=device).half()
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_ref(x), atol=2e-3, rtol=2e-3)


def test_rejects_odd_width(device):
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.randn(2, 5, device=device))
