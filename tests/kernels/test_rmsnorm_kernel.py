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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unsummed_parts_are_summed_before_the_residual_add(device, dtype):
    # x (T, P, hidden) against a residual (T, hidden): an MoE's top-k outputs left unsummed. The same
    # as summing them first (fp32, rounded to x's dtype) and then the residual add + norm.
    from pagedllm.layers.layernorm import RMSNorm

    parts = torch.randn(5, 3, 96, device=device).to(dtype)
    residual = torch.randn(5, 96, device=device).to(dtype)
    w = torch.randn(96, device=device).to(dtype)
    norm = RMSNorm(96, 1e-5).to(device, dtype)
    norm.weight.data.copy_(w)
    summed = parts.float().sum(dim=1).to(dtype)
    out, new_residual = rms_norm(parts, w, 1e-5, residual=residual)
    ref_out, ref_residual = rms_norm(summed, w, 1e-5, residual=residual)
    torch.testing.assert_close(new_residual, ref_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=0, rtol=0)
    # The reference and the layer (its torch path off CUDA) take the parts the same way.
    for got, ref in ((rms_norm_ref(parts, w, 1e-5, residual=residual), rms_norm_ref(summed, w, 1e-5, residual=residual)),
                     (norm(parts, residual), norm(summed, residual))):
        torch.testing.assert_close(got[0], ref[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)
