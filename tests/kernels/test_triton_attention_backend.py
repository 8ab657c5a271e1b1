"""`TritonAttentionBackend` end to end (write K/V, then attend) against `TorchAttentionBackend`."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import TorchAttentionBackend
from pagedllm.attention.triton_backend import TritonAttentionBackend


@pytest.mark.parametrize("num_splits", [None, 2])
def test_matches_torch_backend(make_batch, device, num_splits):
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    md, kv_cache = make_batch([6, 1, 1], [6, 20, 9], 4, num_kv_heads, head_dim, device)
    md.slot_mapping[7] = -1  # the last decode's K/V is already cached: skip its write
    t = md.num_actual_tokens + 1  # plus one CUDA-graph padding row
    query = torch.randn(t, num_heads, head_dim, device=device)
    key = torch.randn(t, num_kv_heads, head_dim, device=device)
    value = torch.randn(t, num_kv_heads, head_dim, device=device)
    ref_cache = kv_cache.clone()
    ref = TorchAttentionBackend().forward(query, key, value, ref_cache, md, 0.3)
    backend = TritonAttentionBackend(num_splits=num_splits)
    assert backend.name == "triton"
    out = backend.forward(query, key, value, kv_cache, md, 0.3)
    assert torch.equal(kv_cache, ref_cache)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_profiling_pass_without_cache(make_batch, device):
    md, _ = make_batch([3, 2], [3, 2], 4, 1, 16, device)
    q = torch.randn(5, 2, 16, device=device)
    k = torch.randn(5, 1, 16, device=device)
    v = torch.randn(5, 1, 16, device=device)
    out = TritonAttentionBackend().forward(q, k, v, None, md, 0.25)
    torch.testing.assert_close(out, TorchAttentionBackend().forward(q, k, v, None, md, 0.25))


def test_rejects_bad_num_splits():
    with pytest.raises(ValueError):
        TritonAttentionBackend(num_splits=0)
