"""The fused decode kernel's keys-as-M loop (`decode_attention.DECODE_VARIANTS` 3: with an fp8 cache an e4m3
QK dot, q quantized per row) against the fp32 reference.

q's e4m3 rounding is the variant's one approximation beyond fp16 P, so the exact test builds inputs
that quantize without rounding: every q row's largest |value| is 56 and every value is an e4m3
number times 1/8, the rotation is the identity (position 0) and there are no q/k norms; the new key and
value are e4m3 numbers too (q is them times 2^-3: its row scale 56 / 448 = 1/8 is exact, and
folding it into the score scale is tested), so the cache write is exact (Triton 3.6's CPU interpreter rounds some
values to e4m3 one binade off: test_kv_cache_fp8_kernels.py). What is left is fp16 P in the PV dot."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.decode_attention import DECODE_VARIANTS, decode_attention_fused, decode_attention_fused_ref
from tests.kernels.test_decode_attention import SEQ_LENS, _batch

FP8 = torch.float8_e4m3fn
H, KVH, D = 8, 2, 64


def _e4m3_values(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """fp32 values that are e4m3 numbers (no subnormals: the interpreter rounds those off)."""
    x = (torch.randn(shape) * scale).to(FP8).float()
    return torch.where(x.abs() < 2.0**-6, torch.zeros_like(x), x)


def _exact_batch(device: torch.device):
    qkv, _, cos_sin, _, md, _ = _batch(H, KVH, D, D, 16, False, device)
    n = qkv.shape[0]
    q = _e4m3_values((n, H, D), 40.0)
    q[:, :, 3] = 448.0 * torch.sign(torch.randn(n, H))  # each row's amax
    q = q / 8.0  # q scale 56 / 448 = 1/8 exactly; q / scale gives the e4m3 values back
    kv_new = _e4m3_values((n, 2 * KVH * D), 2.0)
    qkv = torch.cat([q.reshape(n, H * D), kv_new], 1).to(device)
    cache = _e4m3_values((2, 128, 16, KVH, D), 2.0).to(FP8).to(device)
    positions = torch.zeros(n, dtype=torch.long, device=device)  # rotation by angle 0: the identity
    return qkv, positions, cos_sin, cache, md


KEYS_AS_M = [v for v in DECODE_VARIANTS if v != 0]


@pytest.mark.parametrize("variant", KEYS_AS_M)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fp8_keys_as_m_matches_reference_on_exact_inputs(device, num_splits, variant):
    qkv, positions, cos_sin, cache, md = _exact_batch(device)
    ref_cache = cache.clone()
    scale = 1.0 / (56.0 * 8.0)  # scores of a few units: the softmax is not one-hot
    out = decode_attention_fused(qkv, positions, cos_sin, cache, md, scale, H, KVH, D, num_splits=num_splits,
                                 variant=variant)
    ref = decode_attention_fused_ref(qkv, positions, cos_sin, ref_cache, md, scale, H, KVH, D)
    n = len(SEQ_LENS) - 1  # the padding row is left out, as in test_decode_attention
    # P (in [0, 1]) rounds to fp16 for the PV dot: 2^-11 relative a term.
    torch.testing.assert_close(out[:n], ref[:n], atol=2e-3, rtol=2e-3)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


@pytest.mark.parametrize("variant", KEYS_AS_M)
def test_fp8_keys_as_m_on_random_inputs(device, variant):
    # Random q (rounded to e4m3 in the kernel: 3 mantissa bits) against the fp32 reference on the same
    # fp8 cache: the error is q's rounding, a few % of the output's scale at most.
    qkv, positions, cos_sin, cache, md, (qw, kw) = _batch(H, KVH, D, D, 16, True, device)
    cache = cache.to(FP8)
    ref = decode_attention_fused_ref(qkv, positions, cos_sin, cache.clone(), md, 0.125, H, KVH, D, qw, kw, 1e-6)
    n = len(SEQ_LENS) - 1
    out = decode_attention_fused(qkv, positions, cos_sin, cache.clone(), md, 0.125, H, KVH, D, qw, kw, 1e-6,
                                 variant=variant)
    err = (out[:n] - ref[:n]).abs().max() / ref[:n].abs().max()
    assert err < (0.05 if device.type == "cuda" else 0.2), err  # CPU: the interpreter's e4m3 roundings


@pytest.mark.parametrize("variant", KEYS_AS_M)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_keys_as_m_on_a_32_bit_cache(device, num_splits, variant):
    # The keys-as-M loop on a 32-bit cache (the CPU reference's dtype): q stays unquantized, so it equals the
    # reference as variant 0 does.
    qkv, positions, cos_sin, cache, md, (qw, kw) = _batch(H, KVH, D, D, 16, True, device)
    ref_cache = cache.clone()
    out = decode_attention_fused(qkv, positions, cos_sin, cache, md, 0.125, H, KVH, D, qw, kw, 1e-6,
                                 num_splits=num_splits, variant=variant)
    ref = decode_attention_fused_ref(qkv, positions, cos_sin, ref_cache, md, 0.125, H, KVH, D, qw, kw, 1e-6)
    n = len(SEQ_LENS) - 1
    torch.testing.assert_close(out[:n], ref[:n], atol=1e-4, rtol=1e-4)


def test_unknown_variant_is_refused(device):
    qkv, positions, cos_sin, cache, md, _ = _batch(H, KVH, D, D, 16, False, device)
    with pytest.raises(ValueError, match="variant must be one of"):
        decode_attention_fused(qkv, positions, cos_sin, cache, md, 0.125, H, KVH, D, variant=1)  # removed
    with pytest.raises(ValueError, match="variant must be one of"):
        decode_attention_fused(qkv, positions, cos_sin, cache, md, 0.125, H, KVH, D, variant=2)  # removed
    with pytest.raises(ValueError, match="variant must be one of"):
        decode_attention_fused(qkv, positions, cos_sin, cache, md, 0.125, H, KVH, D, variant=max(DECODE_VARIANTS) + 1)
