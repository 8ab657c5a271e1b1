"""Fused q/k norm + rotary + KV write against its reference and against the unfused kernels, and the
`Attention.forward_qkv` hook that uses it (fused vs unfused layer output)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.kv_cache_write import write_kv_cache
from pagedllm.kernels.qkv_prep import fused_qkv_prep, fused_qkv_prep_ref
from pagedllm.kernels.rmsnorm import rms_norm
from pagedllm.kernels.rotary import build_cos_sin_cache, rotary_embedding
from pagedllm.layers.rotary_embedding import get_rope
from pagedllm.models.qwen3 import Qwen3Attention

# Triton's interpreter runs numpy step by step, so on the CPU the fused kernel rounds exactly like
# the unfused ones; on a GPU the compiler may contract multiply-adds differently.
EXACT = not torch.cuda.is_available()
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _inputs(t, h, kvh, d, rot_dim, block_size, dtype, device, norm=True, num_blocks=16):
    qkv = torch.randn(t, (h + 2 * kvh) * d, device=device).to(dtype)
    positions = torch.randint(0, 64, (t,), device=device)
    cos_sin = build_cos_sin_cache(rot_dim, 64, device=device)
    kv_cache = torch.randn(2, num_blocks, block_size, kvh, d, device=device).to(dtype)
    # Distinct slots spread over the cache; every third token is padding (-1).
    slots = torch.randperm(num_blocks * block_size, device=device)[:t]
    slots[1::3] = -1
    weights = [(1.0 + 0.3 * torch.randn(d, device=device)).to(dtype) if norm else None for _ in range(2)]
    return qkv, positions, cos_sin, kv_cache, slots, weights


def _unfused(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d, qw, kw, eps):
    # Today's CUDA sequence: split, rms_norm per head, rotary in place, write_kv_cache.
    t = qkv.shape[0]
    q, k, v = qkv.clone().split([h * d, kvh * d, kvh * d], dim=-1)
    if qw is not None:
        q = rms_norm(q.reshape(t, h, d), qw, eps).reshape(t, h * d)
    if kw is not None:
        k = rms_norm(k.reshape(t, kvh, d), kw, eps).reshape(t, kvh * d)
    rotary_embedding(positions, q, k, d, cos_sin)
    s = slots.shape[0]
    write_kv_cache(k[:s].reshape(s, kvh, d), v[:s].reshape(s, kvh, d), kv_cache, slots)
    return q.reshape(t, h, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "t,d,rot_dim,block_size,norm",
    [
        (1, 32, 32, 16, True),  # decode, Qwen3-like
        (1, 32, 32, 16, False),  # decode, Llama-like
        (37, 32, 16, 4, True),  # prefill, partial rotary, small blocks
        (5, 48, 32, 16, False),  # head_dim not a power of two, partial rotary
    ],
)
def test_matches_reference_and_unfused(device, dtype, t, d, rot_dim, block_size, norm):
    h, kvh, eps = 8, 2, 1e-6
    qkv, positions, cos_sin, kv_cache, slots, (qw, kw) = _inputs(t, h, kvh, d, rot_dim, block_size, dtype,
                                                                  device, norm)
    qkv_before = qkv.clone()
    ref_cache, unfused_cache = kv_cache.clone(), kv_cache.clone()
    q = fused_qkv_prep(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d, qw, kw, eps)
    q_ref = fused_qkv_prep_ref(qkv, positions, cos_sin, ref_cache, slots, h, kvh, d, qw, kw, eps)
    q_unfused = _unfused(qkv, positions, cos_sin, unfused_cache, slots, h, kvh, d, qw, kw, eps)
    assert torch.equal(qkv, qkv_before)  # the input is only read
    assert q.shape == (t, h, d) and q.dtype == dtype and q.is_contiguous()
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(kv_cache, ref_cache, **TOL[dtype])
    if EXACT:
        assert torch.equal(q, q_unfused)
        assert torch.equal(kv_cache, unfused_cache)
    else:
        torch.testing.assert_close(q, q_unfused, **TOL[dtype])
        torch.testing.assert_close(kv_cache, unfused_cache, **TOL[dtype])


@pytest.mark.parametrize("heads_per_block", [1, 2, 4, 16])
def test_work_split_and_padding(device, heads_per_block):
    # GQA 6/2 with every head grouping, a partial last q group (h=6), padding slots and S < T.
    t, h, kvh, d, rot_dim, block_size = 7, 6, 2, 16, 8, 4
    qkv, positions, cos_sin, kv_cache, slots, (qw, kw) = _inputs(t, h, kvh, d, rot_dim, block_size,
                                                                  torch.float32, device)
    slots = slots[:5]  # tokens 5, 6 are CUDA-graph padding: no slot entry, never written
    before = kv_cache.clone()
    ref_cache = kv_cache.clone()
    q = fused_qkv_prep(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d, qw, kw,
                       heads_per_block=heads_per_block)
    q_ref = fused_qkv_prep_ref(qkv, positions, cos_sin, ref_cache, slots, h, kvh, d, qw, kw)
    torch.testing.assert_close(q, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv_cache, ref_cache, atol=1e-5, rtol=1e-5)
    # Exactly the slots of tokens with a slot >= 0 changed; everything else is untouched.
    written = slots[slots >= 0].tolist()
    flat_now, flat_before = kv_cache.view(2, -1, kvh, d), before.view(2, -1, kvh, d)
    changed = (flat_now != flat_before).flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert sorted(changed) == sorted(written)
    # V is copied as is; K is the normed, rotated k.
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    assert torch.equal(flat_now[1, written[0]], v[0])


def test_partial_rotary_tail_is_only_normed(device):
    # Without norm, features rot_dim.. of every head pass through bit for bit, and position 0 is identity.
    t, h, kvh, d, rot_dim = 3, 2, 1, 32, 8
    qkv, positions, cos_sin, kv_cache, slots, _ = _inputs(t, h, kvh, d, rot_dim, 4, torch.float32, device)
    positions[0] = 0
    q = fused_qkv_prep(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d)
    q_in = qkv[:, : h * d].view(t, h, d)
    assert torch.equal(q[..., rot_dim:], q_in[..., rot_dim:])
    torch.testing.assert_close(q[0], q_in[0], atol=1e-6, rtol=0)
    assert not torch.allclose(q[1:, :, :rot_dim], q_in[1:, :, :rot_dim])


def test_empty_batch_and_bad_inputs(device):
    h, kvh, d = 4, 2, 16
    qkv, positions, cos_sin, kv_cache, slots, _ = _inputs(3, h, kvh, d, 16, 4, torch.float32, device)
    assert fused_qkv_prep(qkv[:0], positions[:0], cos_sin, kv_cache, slots[:0], h, kvh, d).shape == (0, h, d)
    with pytest.raises(ValueError, match="qkv must be"):
        fused_qkv_prep(qkv[:, :-1], positions, cos_sin, kv_cache, slots, h, kvh, d)
    with pytest.raises(ValueError, match="kv_cache must be"):
        fused_qkv_prep(qkv, positions, cos_sin, kv_cache[:, :, :, :1], slots, h, kvh, d)
    with pytest.raises(ValueError, match="slot_mapping"):
        fused_qkv_prep(qkv, positions, cos_sin, kv_cache, torch.cat([slots, slots]), h, kvh, d)
    with pytest.raises(ValueError, match="rot_dim"):
        fused_qkv_prep(qkv, positions, build_cos_sin_cache(2 * d, 8, device=device), kv_cache, slots, h, kvh, d)
    with pytest.raises(ValueError, match="q_norm_weight"):
        fused_qkv_prep(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d, torch.ones(d + 1, device=device))
    with pytest.raises(ValueError, match="heads_per_block"):
        fused_qkv_prep(qkv, positions, cos_sin, kv_cache, slots, h, kvh, d, heads_per_block=3)


@pytest.mark.parametrize("partial_rotary", [1.0, 0.5])
def test_attention_layer_fused_matches_unfused(device, monkeypatch, partial_rotary):
    # A tiny Qwen3 attention (q_norm/k_norm, GQA 4/2, head_dim 32) on the Triton backend: the fused
    # prep path and today's split -> norm -> rope -> backend.forward give the same output and cache.
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    rope = get_rope(32, 64, {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": partial_rotary})
    attn = Qwen3Attention(config, rope, prefix="layers.0.self_attn").to(device)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    block_size, num_blocks = 4, 12
    # A prefill of 5 (new request) and a decode at position 9, plus one CUDA-graph padding row.
    md = build_metadata([5, 1], [5, 10], [[3, 7], [0, 5, 11]], block_size, device=device)
    positions = torch.tensor([0, 1, 2, 3, 4, 9, 0], device=device)
    hidden = torch.randn(7, 64, device=device)
    cache0 = torch.randn(2, num_blocks, block_size, 2, 32, device=device)
    outs, caches = [], []
    for fused in (True, False):
        cache = cache0.clone()
        backend = TritonAttentionBackend(fused_qkv_prep=fused)
        attn.attn.bind_kv_cache(cache, backend)
        qkv = attn.qkv_proj(hidden)
        assert backend.uses_fused_prep(qkv, rope, cache, attn.q_norm, attn.k_norm) == fused
        with torch.no_grad():
            outs.append(attn(positions, hidden, md))
        caches.append(cache)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(caches[0], cache0)  # the fused path did write K/V


def test_attention_layer_keeps_unfused_path_without_cache_or_fused_backend(device):
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=64)
    rope = get_rope(32, 64, {"rope_type": "default", "rope_theta": 1e4})
    attn = Qwen3Attention(config, rope).to(device)
    qkv = torch.zeros(1, 8 * 32, device=device)
    backend = TritonAttentionBackend()
    assert not backend.uses_fused_prep(qkv, rope, None, attn.q_norm, attn.k_norm)  # profiling pass: no cache
    cache = torch.zeros(2, 1, 4, 2, 32, device=device)
    assert backend.uses_fused_prep(qkv, rope, cache, attn.q_norm, attn.k_norm)
    gptj = get_rope(32, 64, {"rope_type": "default", "rope_theta": 1e4}, is_neox_style=False)
    assert not backend.uses_fused_prep(qkv, gptj, cache, attn.q_norm, attn.k_norm)
