"""Neox rotary kernel (in place) against its reference, and the cache layout against the formula."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kernels.rotary import build_cos_sin_cache, rotary_embedding, rotary_embedding_ref


def test_cache_layout():
    cache = build_cos_sin_cache(rot_dim=4, max_position=8, base=100.0)
    # Row p = [cos(p f0), cos(p f1), sin(p f0), sin(p f1)], f_i = base^(-2i / rot_dim).
    p, f1 = 3, 100.0 ** (-2 / 4)
    expected = torch.tensor([1.0, math.cos(p * f1), 0.0, math.sin(p * f1)])
    expected[0] = math.cos(p * 1.0)
    expected[2] = math.sin(p * 1.0)
    torch.testing.assert_close(cache[p], expected)


@pytest.mark.parametrize("rot_dim", [80, 32])  # full rotary; partial rotary leaves dims 32.. alone
def test_matches_reference(device, rot_dim):
    num_tokens, num_heads, num_kv_heads, head_size = 5, 4, 2, 80
    cache = build_cos_sin_cache(rot_dim, 64, device=device)
    positions = torch.tensor([0, 7, 3, 63, 12], device=device)
    # q and k as column slices of a fused qkv output, flat (tokens, heads * head_size) as models pass them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=device)
    q = qkv[:, : num_heads * head_size]
    k = qkv[:, num_heads * head_size : (num_heads + num_kv_heads) * head_size]
    qkv_before = qkv.clone()
    q_before = q.clone()
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, head_size, cache)
    rotary_embedding(positions, q, k, head_size, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    # Position 0 is the identity, others rotate; a partial rotary leaves each head's tail alone.
    q3, before3 = q.view(num_tokens, num_heads, head_size), q_before.view(num_tokens, num_heads, head_size)
    torch.testing.assert_close(q[0], q_before[0], atol=1e-6, rtol=0)
    assert not torch.allclose(q3[1, :, :rot_dim], before3[1, :, :rot_dim])
    assert torch.equal(q3[:, :, rot_dim:], before3[:, :, rot_dim:])
    assert torch.equal(
        qkv[:, (num_heads + num_kv_heads) * head_size :],
        qkv_before[:, (num_heads + num_kv_heads) * head_size :],
    )


def test_query_only_3d(device):
    cache = build_cos_sin_cache(16, 32, device=device)
    positions = torch.tensor([5, 9], device=device)
    q = torch.randn(2, 3, 16, device=device)
    q_ref = q.clone()
    rotary_embedding_ref(positions, q_ref, None, 16, cache)
    rotary_embedding(positions, q, None, 16, cache)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    # Rotation keeps each pair's norm: a cheap check that the reference itself rotates.
    x = torch.randn(1, 16, device=device)
    y = x.clone()
    rotary_embedding_ref(torch.tensor([9], device=device), y, None, 16, cache)
    torch.testing.assert_close(y.norm(), x.norm())
    assert not torch.allclose(y, x)
