"""Sliding window and logit soft-capping in the paged-attention kernel, against the torch reference
(itself checked against a dense masked softmax written out here)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.torch_ref import paged_attention as torch_paged_attention
from pagedllm.kernels.paged_attention import paged_attention, paged_attention_ref

MIXED_Q = [40, 1, 5, 1, 18]
MIXED_S = [100, 37, 5, 130, 40]


def _dense(q, k, v, q_pos, scale, window, cap):
    # q (Lq, H, D), k/v (S, Hkv, D): one request, written out directly.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    kp = torch.arange(k.shape[0])
    vis = (kp[None, :] <= q_pos[:, None]) & (kp[None, :] > q_pos[:, None] - (window or 10**9))
    s = s.masked_fill(~vis[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("window, cap", [(7, None), (None, 5.0), (33, 2.0)])
def test_reference_matches_dense_softmax(window, cap):
    torch.manual_seed(0)
    q_lens, s_lens, bs = [6, 1], [20, 13], 4
    tables = [list(range(0, 5)), list(range(5, 9))]
    md = build_metadata(q_lens, s_lens, tables, bs)
    cache = torch.zeros(2, 9, bs, 2, 16)
    ks, vs = [torch.randn(s, 2, 16) for s in s_lens], [torch.randn(s, 2, 16) for s in s_lens]
    for r, (k, v) in enumerate(zip(ks, vs)):  # the cached prefix; this step's tokens come as key/value
        flat = cache.view(2, -1, 2, 16)
        slots = torch.tensor([tables[r][p // bs] * bs + p % bs for p in range(s_lens[r])])
        flat[0][slots], flat[1][slots] = k, v
        if window:  # blocks wholly behind the window may be freed and reused (core/): never read
            for i in range(max(s_lens[r] - q_lens[r] - window + 1, 0) // bs):
                cache[:, tables[r][i]] = float("nan")
    query = torch.randn(sum(q_lens), 4, 16)
    new_k = torch.cat([k[s - q:] for k, q, s in zip(ks, q_lens, s_lens)])
    new_v = torch.cat([v[s - q:] for v, q, s in zip(vs, q_lens, s_lens)])
    out = torch_paged_attention(query, new_k, new_v, cache, md, 0.25, window, cap)
    start = 0
    for r, (q, s) in enumerate(zip(q_lens, s_lens)):
        ref = _dense(query[start:start + q], ks[r], vs[r], torch.arange(s - q, s), 0.25, window, cap)
        torch.testing.assert_close(out[start:start + q], ref, atol=1e-5, rtol=1e-5)
        start += q


@pytest.mark.parametrize("window, cap, num_splits", [(7, None, None), (64, None, 4), (None, 30.0, None),
                                                     (20, 10.0, 1)])
def test_kernel_window_and_softcap_match_reference(make_batch, device, window, cap, num_splits):
    md, kv_cache = make_batch(MIXED_Q, MIXED_S, 4, 1, 64, device, num_blocks=96)
    query = torch.randn(md.num_actual_tokens, 4, 64, device=device)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    out = paged_attention(query, kv_cache, md, 0.125, num_splits=num_splits, **kw)
    ref = paged_attention_ref(query, kv_cache, md, 0.125, **kw)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if window:  # the window changed the result (the test would pass on a kernel that ignores it otherwise)
        assert not torch.allclose(ref, paged_attention_ref(query, kv_cache, md, 0.125, logits_soft_cap=cap), atol=1e-3)
