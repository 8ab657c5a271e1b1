"""MLA's fused prep (kernels/mla_prep.py: latent norm, both rotaries, the cache write and the query's
rope part in one kernel) equals its torch reference and, inside the DeepSeek layer, the unfused path
(RMSNorm, rotary kernel, cat, write_latents, copy) on decode-only and mixed steps."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.kernels.mla_prep import mla_prep, mla_prep_ref
from pagedllm.kernels.rotary import build_cos_sin_cache

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r, p, h", [(32, 8, 3), (40, 12, 4)])  # powers of two, and padded widths
def test_mla_prep_matches_reference(dtype, r, p, h):
    g = torch.Generator().manual_seed(1)
    t, nope, num_slots = 6, 16, 20
    q = torch.randn(t, h, nope + p, generator=g).to(DEVICE, dtype)
    latent = torch.randn(t, r + p, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(r, generator=g)).to(DEVICE, dtype)
    cos_sin = build_cos_sin_cache(p, 64).to(DEVICE)
    positions = torch.tensor([0, 5, 63, 7, 7, 2], device=DEVICE)
    slots = torch.tensor([3, -1, 19, 0, 11, 8], device=DEVICE)  # token 5 is past num_write
    outs = []
    for fn in (mla_prep_ref, mla_prep):
        lat = latent.clone()
        query = torch.full((t, h, r + p), 7.0, dtype=dtype, device=DEVICE)
        cache = torch.zeros(1, num_slots // 4, 4, 1, r + p, dtype=dtype, device=DEVICE)
        q_in = q.clone()
        fn(positions, q_in[..., nope:], query[..., r:], lat, weight, 1e-6, cos_sin, cache, slots, 5)
        assert torch.equal(q_in, q)  # the query's source is read only
        assert (query[..., :r] == 7.0).all()  # only the rope part is written
        outs.append((query, lat, cache))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(b, a, **tol)
    flat = outs[1][2].view(-1, r + p)
    assert torch.equal(flat[[3, 19, 0, 11]], outs[1][1][[0, 2, 3, 4]])  # the rows written are the latents
    assert (flat[8] == 0).all()  # token 5 (slot 8) is not written: num_write 5
    # The norm and rotary match the standalone reference kernels' references.
    from pagedllm.kernels.rmsnorm import rms_norm_ref
    from pagedllm.kernels.rotary import rotary_embedding_ref

    kv_c = rms_norm_ref(latent[:, :r], weight, 1e-6)
    torch.testing.assert_close(outs[1][1][:, :r], kv_c, **tol)
    q_ref, k_ref = q[..., nope:].reshape(t, -1).clone(), latent[:, r:].clone()
    rotary_embedding_ref(positions, q_ref, k_ref, p, cos_sin)  # in place
    torch.testing.assert_close(outs[1][0][..., r:].reshape(t, -1), q_ref, **tol)
    torch.testing.assert_close(outs[1][1][:, r:], k_ref, **tol)


def _layer():
    from transformers import DeepseekV2Config

    from pagedllm.layers.rotary_embedding import get_rope, get_rope_parameters
    from pagedllm.models.deepseek_v2 import DeepseekV2MLAAttention

    config = DeepseekV2Config(hidden_size=32, num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                              qk_nope_head_dim=16, v_head_dim=24, q_lora_rank=None, max_position_embeddings=128)
    rope = get_rope(8, 128, get_rope_parameters(config), is_neox_style=True)
    layer = DeepseekV2MLAAttention(config, rope, prefix="model.layers.0.self_attn")
    g = torch.Generator().manual_seed(3)
    for prm in layer.parameters():
        prm.data.copy_(0.2 * torch.randn(prm.shape, generator=g))
    return layer.to(DEVICE)


@pytest.mark.parametrize("q_lens, s_lens", [([1, 1, 1], [9, 30, 3]), ([5, 1, 7], [5, 12, 20])])
def test_deepseek_layer_fused_prep_equals_unfused(q_lens, s_lens, monkeypatch):
    from pagedllm.attention.mla import MLAAttention
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    layer = _layer()
    block_size, tables, nxt = 4, [], 0
    for s in s_lens:
        n = -(-s // block_size)
        tables.append(list(range(nxt, nxt + n))[::-1])
        nxt += n
    md = build_metadata(q_lens, s_lens, tables, block_size, device=DEVICE)
    t = sum(q_lens)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, 32, generator=g).to(DEVICE)
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(q_lens, s_lens)]).to(DEVICE)
    cache0 = torch.randn(1, nxt, block_size, 1, 40, generator=g).to(DEVICE)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(MLAAttention, "uses_fused_prep", lambda self, latent, rope, f=fused: f)
        cache = cache0.clone()
        layer.attn.bind_kv_cache(cache, TritonAttentionBackend())
        results.append((layer(positions, x, md), cache))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results[1][1], results[0][1], atol=1e-6, rtol=1e-6)
