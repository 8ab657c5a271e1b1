"""An FP8 (e4m3) KV cache in every kernel that writes or reads it, against the torch reference on
the same fp8 cache: the cache write, the unified paged attention (prefill + decode, split-K), the
fused q/k prep, and the fused decode kernel. Keys/values are rounded to e4m3 on the way in (torch and
Triton both saturate at +-448) and widened on the way out."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.torch_ref import write_kv_cache as write_kv_cache_torch
from pagedllm.kernels.decode_attention import decode_attention_fused, decode_attention_fused_ref
from pagedllm.kernels.kv_cache_write import write_kv_cache
from pagedllm.kernels.paged_attention import paged_attention, paged_attention_ref
from tests.kernels.test_decode_attention import SEQ_LENS, _batch

FP8 = torch.float8_e4m3fn


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal on a GPU (Triton and torch both round to nearest even). Triton 3.6's CPU interpreter
    loses the carry when a value rounds up into the next power of two (-0.4995 -> -0.25, not -0.5)
    and rounds some subnormals (|x| < 2^-6) one step (2^-9) off; there every mismatch must be one of
    those two cases."""
    if got.is_cuda:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    g, w = got.float(), want.float()
    bad = g != w
    lost_carry = (g * 2 == w) & (torch.frexp(w).mantissa.abs() == 0.5)
    subnormal_step = (w.abs() <= 2.0**-6) & ((g - w).abs() <= 2.0**-9)
    ok = lost_carry | subnormal_step | ~bad
    assert ok.all(), (g[~ok][:8], w[~ok][:8])


# The interpreter's lost carries (a few % of the keys off by a binade) move attention outputs by up to
# a few 1e-2; on a GPU the kernels match the reference to fp32 rounding.
ATOL = 1e-4 if torch.cuda.is_available() else 0.1


def test_cache_write_rounds_and_saturates(device):
    cache = torch.zeros(2, 4, 4, 2, 16, device=device).to(FP8)
    expected = cache.clone()
    key = torch.randn(5, 2, 16, device=device) * 400  # many beyond e4m3's 448
    value = torch.randn(5, 2, 16, device=device)
    slots = torch.tensor([3, 0, -1, 9, 15], device=device)
    write_kv_cache(key, value, cache, slots)
    write_kv_cache_torch(key, value, expected, slots)
    assert_same_fp8(cache, expected)
    flat = cache.view(2, -1, 2, 16).float()
    assert flat.abs().max() == 448.0
    assert_same_fp8(cache.view(2, -1, 2, 16)[1][9], value[3].to(FP8))  # slot 9 <- token 3


@pytest.mark.parametrize("num_splits", [None, 4])
def test_paged_attention_reads_fp8(make_batch, device, num_splits):
    md, kv_cache = make_batch([40, 1, 5, 1], [100, 37, 5, 130], 16, 2, 64, device, num_blocks=64)
    kv_cache = kv_cache.to(FP8)
    query = torch.randn(md.num_actual_tokens, 4, 64, device=device)
    out = paged_attention(query, kv_cache, md, 0.125, num_splits=num_splits)
    ref = paged_attention_ref(query, kv_cache, md, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # ... and the reference is attention over the widened cache, not something else.
    wide = paged_attention_ref(query, kv_cache.float(), md, 0.125)
    torch.testing.assert_close(ref, wide, atol=1e-5, rtol=1e-5)


def test_bf16_queries_on_an_fp8_cache_compute_in_fp16(make_batch, device):
    # attention_tile: a bf16 q on an e4m3 cache runs its dots in fp16 (e4m3 -> fp16 is one cvt per two
    # values on sm_90, -> bf16 three): same result as the fp32 reference to bf16 output rounding, and a
    # q beyond fp16's range is clamped instead of turning the scores into inf / NaN.
    md, kv_cache = make_batch([1, 1, 1], [100, 37, 130], 16, 2, 64, device, num_blocks=32)
    kv_cache = kv_cache.to(FP8)
    query = torch.randn(md.num_actual_tokens, 4, 64, device=device)
    ref = paged_attention_ref(query, kv_cache, md, 0.125)
    out = paged_attention(query.bfloat16(), kv_cache, md, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    huge = query.clone()
    huge[0, 0, 0] = 1e6
    assert torch.isfinite(paged_attention(huge.bfloat16(), kv_cache, md, 0.125)).all()


@pytest.mark.parametrize("variant", [0, None], ids=["fp16-dots", "default"])
def test_fused_decode_writes_and_reads_fp8(device, variant):
    # variant 0 widens the cache to fp16 (the reference's values exactly); the default for an fp8 cache
    # (decode_attention.FP8_KV_VARIANT) rounds q to e4m3 for its QK dot: held to a few % of the output.
    qkv, positions, cos_sin, kv_cache, md, (qw, kw) = _batch(8, 2, 64, 64, 16, True, device)
    kv_cache = kv_cache.to(FP8)
    ref_cache = kv_cache.clone()
    out = decode_attention_fused(qkv, positions, cos_sin, kv_cache, md, 0.125, 8, 2, 64, qw, kw, 1e-6, num_splits=2,
                                 variant=variant)
    ref = decode_attention_fused_ref(qkv, positions, cos_sin, ref_cache, md, 0.125, 8, 2, 64, qw, kw, 1e-6)
    n = len(SEQ_LENS) - 1  # the padding row is left out, as in test_decode_attention
    tol = ATOL if variant == 0 else max(ATOL, 5e-2)
    torch.testing.assert_close(out[:n], ref[:n], atol=tol * ref[:n].abs().max().item(), rtol=0)
    assert_same_fp8(kv_cache, ref_cache)
