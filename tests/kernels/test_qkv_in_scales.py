"""qkv_proj's deferred FP8 scales (PAGEDLLM_FP8_DEFER_SCALES) applied in the fused attention kernels: given a
ScaledOutput's unscaled sums and its scales (in_scales: row (T, 1), col (width,)), `fused_qkv_prep` and
`decode_attention_fused` give bit for bit what `scaled_mm.materialize` followed by the same kernel without
scales gives (q, the output and every cache byte), as the kernels round each value read exactly as
materialize stores it; and their references (which materialize first) agree."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.decode_attention import decode_attention_fused, decode_attention_fused_ref
from pagedllm.kernels.qkv_prep import fused_qkv_prep, fused_qkv_prep_ref
from pagedllm.kernels.quantized_activation import ScaledOutput
from pagedllm.kernels.scaled_mm import materialize
from tests.kernels.test_decode_attention import _batch
from tests.kernels.test_qkv_prep import _inputs

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _deferred(t: int, width: int, device: torch.device) -> ScaledOutput:
    """A qkv_proj output as the unit-scale FP8 GEMM leaves it: large bf16 sums, small per-token and per-column
    scales (their product brings the values back to O(1))."""
    acc = (torch.randn(t, width, device=device) * 300).to(BF16)
    return ScaledOutput(acc, torch.rand(t, 1, device=device) * 1e-2 + 1e-3,
                        torch.rand(width, device=device) * 1e-2 + 1e-3)


@pytest.mark.parametrize("cache_dtype", [BF16, FP8], ids=["bf16-cache", "fp8-cache"])
@pytest.mark.parametrize("norm", [True, False], ids=["qk-norm", "no-norm"])
def test_prep_applies_in_scales_as_materialize(device, norm, cache_dtype):
    # GQA 8 / 2, partial rotary (features 16..31 only scaled, never rotated), padding slots (-1)
    t, h, kvh, d, rot_dim = 7, 8, 2, 32, 16
    _, positions, cos_sin, kv_cache, slots, (qw, kw) = _inputs(t, h, kvh, d, rot_dim, 4, BF16, device, norm)
    y = _deferred(t, (h + 2 * kvh) * d, device)
    cache = kv_cache.to(cache_dtype)
    pair_cache, ref_cache = cache.clone(), cache.clone()
    q = fused_qkv_prep(y.acc, positions, cos_sin, cache, slots, h, kvh, d, qw, kw, in_scales=(y.row_scale,
                                                                                              y.col_scale))
    pair_q = fused_qkv_prep(materialize(y), positions, cos_sin, pair_cache, slots, h, kvh, d, qw, kw)
    assert torch.equal(q, pair_q)
    assert torch.equal(cache.view(torch.uint8), pair_cache.view(torch.uint8))  # every cache byte
    if cache_dtype == BF16:  # (the interpreter's e4m3 rounding is held to the Triton pair only)
        ref_q = fused_qkv_prep_ref(y.acc, positions, cos_sin, ref_cache, slots, h, kvh, d, qw, kw,
                                   in_scales=(y.row_scale, y.col_scale))
        torch.testing.assert_close(q, ref_q, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(cache, ref_cache, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 4], ids=["one-split", "split-k"])
@pytest.mark.parametrize("h,kvh,d,rot_dim,block_size,norm", [
    (8, 2, 64, 64, 16, True),  # GQA 4:1, Qwen3-like norms
    (4, 4, 32, 16, 4, False),  # MHA, partial rotary, Llama-like
])
def test_decode_applies_in_scales_as_materialize(device, h, kvh, d, rot_dim, block_size, norm, num_splits, dtype):
    # bf16 is the deferring GEMM's output; an fp32 acc (no rounding in the scaling) checks the attention output
    # against the reference on the CPU too, where Triton's interpreter gets bf16 attention dots wrong (the
    # plain kernels' as well: the existing decode tests are fp32), so bf16 is held there to the pair only.
    qkv, positions, cos_sin, kv_cache, md, (qw, kw) = _batch(h, kvh, d, rot_dim, block_size, norm, device)
    y = _deferred(qkv.shape[0], qkv.shape[1], device)
    y = ScaledOutput(y.acc.to(dtype), y.row_scale, y.col_scale)
    qw, kw = (w.to(dtype) if w is not None else None for w in (qw, kw))
    cache = kv_cache.to(dtype)
    pair_cache, ref_cache = cache.clone(), cache.clone()
    scale = d**-0.5
    out = decode_attention_fused(y.acc, positions, cos_sin, cache, md, scale, h, kvh, d, qw, kw,
                                 num_splits=num_splits, in_scales=(y.row_scale, y.col_scale))
    pair = decode_attention_fused(materialize(y), positions, cos_sin, pair_cache, md, scale, h, kvh, d, qw, kw,
                                  num_splits=num_splits)
    assert torch.equal(out, pair) and torch.equal(cache, pair_cache)
    ref = decode_attention_fused_ref(y.acc, positions, cos_sin, ref_cache, md, scale, h, kvh, d, qw, kw,
                                     in_scales=(y.row_scale, y.col_scale))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(cache, ref_cache, atol=tol, rtol=tol)
    if dtype == torch.float32 or out.is_cuda:
        torch.testing.assert_close(out[:-1], ref[:-1], atol=tol, rtol=tol)  # (the last row: graph padding)


def test_decode_on_an_fp8_cache_applies_in_scales_as_materialize(device):
    h, kvh, d = 8, 2, 64
    qkv, positions, cos_sin, kv_cache, md, (qw, kw) = _batch(h, kvh, d, d, 16, False, device)
    y = _deferred(qkv.shape[0], qkv.shape[1], device)
    cache = kv_cache.to(FP8)
    pair_cache = cache.clone()
    out = decode_attention_fused(y.acc, positions, cos_sin, cache, md, 0.125, h, kvh, d,
                                 in_scales=(y.row_scale, y.col_scale))
    pair = decode_attention_fused(materialize(y), positions, cos_sin, pair_cache, md, 0.125, h, kvh, d)
    assert torch.equal(out, pair)
    assert torch.equal(cache.view(torch.uint8), pair_cache.view(torch.uint8))


def test_in_scales_of_the_wrong_shape_are_refused(device):
    h, kvh, d = 4, 2, 16
    _, positions, cos_sin, kv_cache, slots, _ = _inputs(3, h, kvh, d, 16, 4, BF16, device, False)
    y = _deferred(3, (h + 2 * kvh) * d, device)
    with pytest.raises(ValueError, match="in_scales"):
        fused_qkv_prep(y.acc, positions, cos_sin, kv_cache, slots, h, kvh, d,
                       in_scales=(y.row_scale, y.col_scale[: h * d]))  # q's columns only
    with pytest.raises(ValueError, match="in_scales"):
        fused_qkv_prep(y.acc, positions, cos_sin, kv_cache, slots, h, kvh, d,
                       in_scales=(y.row_scale.double(), y.col_scale))
