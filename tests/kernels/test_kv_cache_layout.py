"""A head-major KV cache (PAGEDLLM_KV_CACHE_LAYOUT=HND: (block, kv head, slot, dim) in memory, the shape still
(2, blocks, slots, kv heads, dim)) through every kernel that reads or writes a standard cache, and the torch
references: the same outputs and the same cache contents as the token-major cache holding the same values."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention import torch_ref
from pagedllm.kernels.decode_attention import decode_attention_fused, decode_attention_fused_ref
from pagedllm.kernels.kv_cache_write import write_kv_cache
from pagedllm.kernels.paged_attention import paged_attention, paged_attention_ref
from pagedllm.kernels.qkv_prep import fused_qkv_prep
from pagedllm.worker import kv_cache
from tests.kernels.conftest import _make_batch
from tests.kernels.test_decode_attention import SEQ_LENS, _batch

FP8 = torch.float8_e4m3fn


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values in the HND order the worker allocates (worker/kv_cache.py)."""
    out = kv_cache.head_major(torch.empty, cache.shape, dtype=cache.dtype, device=cache.device)
    out.copy_(cache)
    _, _, slots, _, dim = cache.shape
    assert not out[0].is_contiguous() and out.stride(-2) == slots * dim  # kv heads are blocks of slots apart
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.element_size() == 1 else t.contiguous()


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_fused_decode_on_a_head_major_cache(device, cache_dtype, num_splits):
    h, kvh, d = 8, 2, 64
    qkv, positions, cos_sin, cache, md, (qw, kw) = _batch(h, kvh, d, d, 16, True, device)
    cache = cache.to(cache_dtype)
    nhd, hnd = cache.clone(), head_major(cache)
    args = (md, 0.125, h, kvh, d, qw, kw)
    want = decode_attention_fused(qkv, positions, cos_sin, nhd, *args, num_splits=num_splits)
    got = decode_attention_fused(qkv, positions, cos_sin, hnd, *args, num_splits=num_splits)
    assert torch.equal(got, want)
    assert torch.equal(bits(hnd), bits(nhd))  # this step's K/V written to the same slots
    if cache_dtype == torch.float32:  # the reference reads and writes either layout alike
        ref_cache = head_major(cache)
        ref = decode_attention_fused_ref(qkv, positions, cos_sin, ref_cache, *args)
        torch.testing.assert_close(got[: len(SEQ_LENS) - 1], ref[: len(SEQ_LENS) - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ref_cache, nhd, atol=1e-5, rtol=1e-5)


def test_prefill_attention_and_writes_on_a_head_major_cache(device):
    h, kvh, d, bs = 4, 2, 32, 16
    md, cache = _make_batch([5, 1, 17], [40, 23, 17], bs, kvh, d, device)
    n = md.num_actual_tokens
    q = torch.randn(n, h, d, device=device)
    key, value = torch.randn(n, kvh, d, device=device), torch.randn(n, kvh, d, device=device)
    nhd, hnd = cache.clone(), head_major(cache)
    write_kv_cache(key, value, nhd, md.slot_mapping[:n])
    write_kv_cache(key, value, hnd, md.slot_mapping[:n])
    assert torch.equal(hnd, nhd)
    ref_cache = head_major(cache)
    torch_ref.write_kv_cache(key, value, ref_cache, md.slot_mapping[:n])
    assert torch.equal(ref_cache, nhd)
    got, want = paged_attention(q, hnd, md, 0.2), paged_attention(q, nhd, md, 0.2)
    assert torch.equal(got, want)
    torch.testing.assert_close(paged_attention_ref(q, hnd, md, 0.2), want, atol=1e-4, rtol=1e-4)
    # The CPU path's attention (the torch reference, gathering whole blocks) on the head-major cache.
    torch.testing.assert_close(torch_ref.paged_attention(q, key, value, head_major(nhd), md, 0.2), want,
                               atol=1e-4, rtol=1e-4)


def test_fused_prep_writes_a_head_major_cache(device):
    h, kvh, d = 8, 2, 64
    qkv, positions, cos_sin, cache, md, (qw, kw) = _batch(h, kvh, d, d, 16, True, device)
    nhd, hnd = cache.clone(), head_major(cache)
    slots = md.slot_mapping
    want = fused_qkv_prep(qkv, positions, cos_sin, nhd, slots, h, kvh, d, qw, kw)
    got = fused_qkv_prep(qkv, positions, cos_sin, hnd, slots, h, kvh, d, qw, kw)
    assert torch.equal(got, want) and torch.equal(hnd, nhd)
