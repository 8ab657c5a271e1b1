"""Decode attention with the q/k prep fused in, against the unfused references (fp32, CPU interpreter
or GPU), and the `Attention.forward_qkv` hook that takes it for decode-only steps."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.decode_attention import decode_attention_fused, decode_attention_fused_ref
from pagedllm.kernels.rotary import build_cos_sin_cache
from pagedllm.layers.rotary_embedding import get_rope
from pagedllm.models.qwen3 import Qwen3Attention

# Contexts after this step's token: long (several 128-key tiles), short, one block exactly, and a
# CUDA-graph padding row (seq_len 1, slot -1: attends only to its own key, writes nothing).
SEQ_LENS = [300, 37, 16, 1]


def _batch(h, kvh, d, rot_dim, block_size, norm, device, num_blocks=128):
    perm = torch.randperm(num_blocks).tolist()
    tables = []
    for s in SEQ_LENS:
        n = -(-s // block_size)
        tables.append(perm[:n])
        perm = perm[n:]
    md = build_metadata([1] * len(SEQ_LENS), SEQ_LENS, tables, block_size, device=device)
    md.slot_mapping[-1] = -1
    n = len(SEQ_LENS)
    qkv = torch.randn(n, (h + 2 * kvh) * d, device=device)
    positions = md.seq_lens.long() - 1
    cos_sin = build_cos_sin_cache(rot_dim, 512, device=device)
    kv_cache = torch.randn(2, num_blocks, block_size, kvh, d, device=device)
    weights = [1.0 + 0.3 * torch.randn(d, device=device) if norm else None for _ in range(2)]
    return qkv, positions, cos_sin, kv_cache, md, weights


@pytest.mark.parametrize(
    "h,kvh,d,rot_dim,block_size,norm",
    [
        (8, 2, 64, 64, 16, True),  # GQA 4:1, Qwen3-like norms
        (4, 4, 32, 16, 4, False),  # MHA, partial rotary, small blocks, Llama-like
        (6, 2, 48, 32, 8, True),  # head_dim not a power of two (padded), 3 heads per kv head
    ],
)
@pytest.mark.parametrize("num_splits", [1, 4])
def test_matches_unfused_reference(device, h, kvh, d, rot_dim, block_size, norm, num_splits):
    qkv, positions, cos_sin, kv_cache, md, (qw, kw) = _batch(h, kvh, d, rot_dim, block_size, norm, device)
    ref_cache = kv_cache.clone()
    scale = d**-0.5
    out = decode_attention_fused(qkv, positions, cos_sin, kv_cache, md, scale, h, kvh, d, qw, kw, 1e-6,
                                 num_splits=num_splits)
    ref = decode_attention_fused_ref(qkv, positions, cos_sin, ref_cache, md, scale, h, kvh, d, qw, kw, 1e-6)
    assert out.shape == (len(SEQ_LENS), h, d) and out.dtype == qkv.dtype
    # The padding row is left out: the pair reads its one key back from a slot it never wrote, the
    # fused kernel takes its own key; a graph drops that row's output either way.
    torch.testing.assert_close(out[:-1], ref[:-1], atol=1e-4, rtol=1e-4)
    # This step's K/V went to the cache exactly as the prep kernel writes them; the padding row wrote nothing.
    torch.testing.assert_close(kv_cache, ref_cache, atol=1e-5, rtol=1e-5)


def test_decode_order_and_padding_rows(device):
    h, kvh, d = 8, 2, 64
    qkv, positions, cos_sin, kv_cache, md, (qw, kw) = _batch(h, kvh, d, d, 16, True, device)
    plain = decode_attention_fused(qkv, positions, cos_sin, kv_cache.clone(), md, 0.125, h, kvh, d, qw, kw)
    # Longest context first: the programs' order, not the result.
    md.decode_order = torch.tensor([0, 1, 2, 3][::-1], dtype=torch.int32, device=device)
    ordered = decode_attention_fused(qkv, positions, cos_sin, kv_cache.clone(), md, 0.125, h, kvh, d, qw, kw)
    torch.testing.assert_close(ordered, plain, atol=1e-6, rtol=1e-6)
    # Rows past the batch's requests (a graph captured for more rows) come back as zeros.
    md.decode_order = None
    longer = torch.cat([qkv, torch.randn(2, qkv.shape[1], device=device)])
    pos = torch.cat([positions, positions[:2]])
    out = decode_attention_fused(longer, pos, cos_sin, kv_cache.clone(), md, 0.125, h, kvh, d, qw, kw)
    torch.testing.assert_close(out[:4], plain, atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(out[4:]) == 0


def test_bad_inputs(device):
    h, kvh, d = 4, 2, 32
    qkv, positions, cos_sin, kv_cache, md, _ = _batch(h, kvh, d, d, 16, False, device)
    with pytest.raises(ValueError, match="qkv must be"):
        decode_attention_fused(qkv[:, :-1], positions, cos_sin, kv_cache, md, 0.1, h, kvh, d)
    with pytest.raises(ValueError, match="positions must be"):
        decode_attention_fused(qkv, positions[:-1], cos_sin, kv_cache, md, 0.1, h, kvh, d)
    with pytest.raises(ValueError, match="kv_cache must be"):
        decode_attention_fused(qkv, positions, cos_sin, kv_cache[:, :, :, :1], md, 0.1, h, kvh, d)
    with pytest.raises(ValueError, match="rot_dim"):
        decode_attention_fused(qkv, positions, build_cos_sin_cache(2 * d, 8, device=device), kv_cache, md, 0.1,
                               h, kvh, d)
    prefill = build_metadata([3], [3], [[0]], 16, device=device)
    with pytest.raises(ValueError, match="decode-only"):
        decode_attention_fused(qkv[:3], positions[:3], cos_sin, kv_cache, prefill, 0.1, h, kvh, d)


def test_attention_layer_takes_fused_decode_path(device, monkeypatch):
    # A tiny Qwen3 attention on the Triton backend, decode-only step: the one-kernel path and the
    # prep + attention pair give the same output and cache; a mixed step never takes it.
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=64, rms_norm_eps=1e-6)
    rope = get_rope(32, 64, {"rope_type": "default", "rope_theta": 1e4})
    attn = Qwen3Attention(config, rope, prefix="layers.0.self_attn").to(device)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    md = build_metadata([1, 1], [10, 3], [[0, 5, 11], [7]], 4, device=device)
    positions = torch.tensor([9, 2], device=device)
    hidden = torch.randn(2, 64, device=device)
    cache0 = torch.randn(2, 12, 4, 2, 32, device=device)
    calls = []
    real = TritonAttentionBackend.forward_decode_qkv
    monkeypatch.setattr(TritonAttentionBackend, "forward_decode_qkv",
                        lambda self, *a: calls.append(1) or real(self, *a))
    outs, caches = [], []
    for fused in (True, False):
        cache = cache0.clone()
        attn.attn.bind_kv_cache(cache, TritonAttentionBackend(fused_decode=fused))
        with torch.no_grad():
            outs.append(attn(positions, hidden, md))
        caches.append(cache)
    assert len(calls) == 1  # the fused run only
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(caches[0], caches[1], atol=1e-5, rtol=1e-5)
    attn.attn.bind_kv_cache(cache, TritonAttentionBackend(fused_decode=True))
    mixed = build_metadata([2, 1], [2, 10], [[1], [0, 5, 11]], 4, device=device)
    with torch.no_grad():
        attn(torch.tensor([0, 1, 9], device=device), torch.randn(3, 64, device=device), mixed)
    assert len(calls) == 1
