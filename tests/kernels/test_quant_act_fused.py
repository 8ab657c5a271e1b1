"""The fused RMSNorm + quantize and SiLU-and-mul + quantize kernels (kernels/quant_act.py) against the
unfused torch pair they replace (rms_norm_ref / silu_and_mul_ref, then quantize_activation)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.activation import silu_and_mul
from pagedllm.kernels.quant_act import (
    quantize_activation_triton,
    rms_norm_quant,
    rms_norm_quant_ref,
    silu_and_mul_quant,
    silu_and_mul_quant_ref,
)
from pagedllm.kernels.rmsnorm import rms_norm
from pagedllm.kernels.scaled_mm import FP8_DTYPE
from tests.kernels.test_quant_act import assert_same_codes

DTYPES = [torch.float32, torch.bfloat16]


def assert_close_codes(xq, scale, ref_q, ref_s, dtype, exact_fp32: bool = True) -> None:
    """Against the torch pair: in bf16 the kernels' activation (rsqrt, sum order, approximate division)
    may round an ulp away from torch's (0.4%), so the scale (amax / qmax) may move by as much and a
    code by a step (e4m3: at most 1/8 of the value; int8: up to two steps of 1/127 of the row's amax);
    in fp32 the same codes. (Triton 3.6's CPU interpreter rounds some values to e4m3 a binade off,
    test_kv_cache_fp8_kernels.assert_same_fp8: there bf16 fp8 codes are held to the Triton pair only.)"""
    if dtype == torch.float32 and exact_fp32:
        torch.testing.assert_close(scale, ref_s, atol=0, rtol=2e-6)
        assert_same_codes(xq, ref_q)
        return
    torch.testing.assert_close(scale, ref_s, atol=0, rtol=1e-2)
    if not xq.is_cuda and xq.dtype == FP8_DTYPE:
        return
    deq, ref_deq = xq.float() * scale, ref_q.float() * ref_s
    assert ((deq - ref_deq).abs() <= 0.13 * ref_deq.abs() + 2.01 * ref_s.expand_as(ref_deq) + 1e-6).all()
    assert (xq.float() != ref_q.float()).float().mean() <= 0.1


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_quant_matches_the_unfused_pair(device, qdtype, dtype, with_residual):
    x = (torch.randn(6, 300, device=device) * 2).to(dtype)  # 300: not a power of two, a masked tail
    x[4] = 0.0  # a zero row (without residual): the scale's floor keeps it finite
    residual = torch.randn(6, 300, device=device).to(dtype) if with_residual else None
    w = (1.0 + 0.3 * torch.randn(300, device=device)).to(dtype)
    xq, scale, r_out = rms_norm_quant(x, w, 1e-6, qdtype, residual)
    ref_q, ref_s, ref_r = rms_norm_quant_ref(x, w, 1e-6, qdtype, residual)
    assert xq.dtype == qdtype and xq.shape == (6, 300) and scale.shape == (6, 1)
    assert_close_codes(xq, scale, ref_q, ref_s, dtype)
    # ... and the same as the two Triton kernels it replaces (the model's unfused GPU path).
    normed = rms_norm(x, w, 1e-6, residual)
    pair_q, pair_s = quantize_activation_triton(normed[0] if with_residual else normed, qdtype)
    torch.testing.assert_close(scale, pair_s, atol=0, rtol=0)
    assert_same_codes(xq, pair_q)
    if with_residual:
        assert torch.equal(r_out, normed[1])  # the Triton norm's sum, bit for bit
        torch.testing.assert_close(r_out, ref_r, atol=0, rtol=1e-2 if dtype == torch.bfloat16 else 0)
    else:
        assert r_out is None


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_rms_norm_quant_applies_a_scaled_outputs_scales(device, dtype):
    # in_scales (a ScaledOutput's row / column scales): the same as materializing x * row * col in x's dtype
    # (kernels/scaled_mm.materialize, the scale epilogue) and then the fused norm, bit for bit.
    from pagedllm.kernels.quant_act import scale_epilogue

    acc = (torch.randn(5, 300, device=device) * 300).to(dtype)  # unscaled fp8 sums: large
    rows = torch.rand(5, 1, device=device) * 1e-2
    cols = torch.rand(300, device=device) * 1e-2
    residual = torch.randn(5, 300, device=device).to(dtype)
    w = (1.0 + 0.3 * torch.randn(300, device=device)).to(dtype)
    xq, scale, r_out = rms_norm_quant(acc, w, 1e-6, FP8_DTYPE, residual, in_scales=(rows, cols))
    y = scale_epilogue(acc, rows, cols, None, 5, dtype)
    pair_q, pair_s, pair_r = rms_norm_quant(y, w, 1e-6, FP8_DTYPE, residual)
    torch.testing.assert_close(scale, pair_s, atol=0, rtol=0)
    assert_same_codes(xq, pair_q)
    assert torch.equal(r_out, pair_r)
    ref_q, ref_s, ref_r = rms_norm_quant_ref(acc, w, 1e-6, FP8_DTYPE, residual, in_scales=(rows, cols))
    assert_close_codes(xq, scale, ref_q, ref_s, dtype)
    with pytest.raises(ValueError, match="in_scales"):
        rms_norm_quant(acc, w, 1e-6, FP8_DTYPE, residual, in_scales=(rows, cols[:10]))


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_and_mul_quant_matches_the_unfused_pair(device, qdtype, dtype):
    x = (torch.randn(5, 2 * 200, device=device) * 3).to(dtype)
    xq, scale = silu_and_mul_quant(x, qdtype)
    ref_q, ref_s = silu_and_mul_quant_ref(x, qdtype)
    assert xq.shape == (5, 200) and scale.shape == (5, 1)
    # The kernel's silu divides approximately (as activation._silu_and_mul_kernel does), the reference
    # with F.silu: in fp32 too the activation may differ by an ulp, so the codes are held to a step.
    assert_close_codes(xq, scale, ref_q, ref_s, dtype, exact_fp32=False)
    pair_q, pair_s = quantize_activation_triton(silu_and_mul(x), qdtype)  # the unfused Triton pair
    torch.testing.assert_close(scale, pair_s, atol=0, rtol=0)
    assert_same_codes(xq, pair_q)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_silu_and_mul_quant_applies_a_scaled_outputs_scales(device, dtype):
    # in_scales (gate_up_proj's ScaledOutput: row (M, 1), col (2 * I,)): gate and up materialized first, so the
    # codes and scales are those of materialize + the plain fused kernel, bit for bit.
    from pagedllm.kernels.quant_act import scale_epilogue

    acc = (torch.randn(5, 2 * 200, device=device) * 300).to(dtype)  # unscaled fp8 sums: large
    rows = torch.rand(5, 1, device=device) * 1e-2
    cols = torch.rand(400, device=device) * 1e-2
    xq, scale = silu_and_mul_quant(acc, FP8_DTYPE, in_scales=(rows, cols))
    pair_q, pair_s = silu_and_mul_quant(scale_epilogue(acc, rows, cols, None, 5, dtype), FP8_DTYPE)
    torch.testing.assert_close(scale, pair_s, atol=0, rtol=0)
    assert_same_codes(xq, pair_q)
    if dtype == torch.float32 or acc.is_cuda:
        # (Triton's CPU interpreter truncates fp32 -> bf16 where the GPU and torch round to nearest: gate and up
        # an ulp off each, the product's amax up to 2% off the reference's. The Triton pair above rounds alike.)
        ref_q, ref_s = silu_and_mul_quant_ref(acc, FP8_DTYPE, in_scales=(rows, cols))
        assert_close_codes(xq, scale, ref_q, ref_s, dtype, exact_fp32=False)
    with pytest.raises(ValueError, match="in_scales"):
        silu_and_mul_quant(acc, FP8_DTYPE, in_scales=(rows, cols[:200]))  # the gate half's scales only


def test_fused_quant_refuses_bad_inputs(device):
    x = torch.randn(3, 64, device=device)
    with pytest.raises(ValueError, match="row-major"):
        rms_norm_quant(x.t(), torch.ones(3, device=device), 1e-6, FP8_DTYPE)
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm_quant(x, torch.ones(63, device=device), 1e-6, FP8_DTYPE)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        silu_and_mul_quant(x, torch.float16)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_quant(torch.randn(3, 65, device=device), FP8_DTYPE)
