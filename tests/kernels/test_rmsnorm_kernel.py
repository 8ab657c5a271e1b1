"""Fused (residual +) RMSNorm kernel against its reference."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.rmsnorm import rms_norm, rms_norm_ref


@pytest.mark.parametrize("shape", [(5, 64), (3, 4, 80)])  # a hidden row; per-head q/k norm, odd width
def test_plain(device, shape):
    x = torch.randn(shape, device=device) * 3
    w = torch.randn(shape[-1], device=device)
    out = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)
    # And the formula itself, so the reference cannot drift.
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_with_residual(device, dtype):
    x = torch.randn(6, 96, device=device).to(dtype)
    residual = torch.randn(6, 96, device=device).to(dtype)
    w = torch.randn(96, device=device).to(dtype)
    x_before, r_before = x.clone(), residual.clone()
    out, new_residual = rms_norm(x, w, 1e-5, residual=residual)
    ref_out, ref_residual = rms_norm_ref(x, w, 1e-5, residual=residual)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(new_residual, ref_residual, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)  # inputs untouched


def test_rejects_wrong_weight(device):
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.randn(2, 8, device=device), torch.ones(4, device=device), 1e-6)
