"""Rotary embedding vs HF's LlamaRotaryEmbedding + apply_rotary_pos_emb, and config parsing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedllm.layers.rotary_embedding import (
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    RotaryEmbedding,
    get_rope,
    get_rope_parameters,
)

HEAD, HEADS, KV_HEADS, MAX_POS = 32, 4, 2, 256
POSITIONS = torch.tensor([0, 1, 5, 37, 100, 255, 3])

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    # Llama 3.1's numbers scaled down: original length 64 puts wavelengths in all three bands.
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
}


def hf_rope(rope_parameters: dict, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    config = LlamaConfig(hidden_size=HEAD * HEADS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_POS, rope_parameters=dict(rope_parameters))
    cos, sin = LlamaRotaryEmbedding(config)(q, POSITIONS[None])
    t = len(POSITIONS)
    # HF layout: (batch, heads, seq, head_dim)
    q4 = q.view(1, t, HEADS, HEAD).transpose(1, 2)
    k4 = k.view(1, t, KV_HEADS, HEAD).transpose(1, 2)
    q_out, k_out = apply_rotary_pos_emb(q4, k4, cos, sin)
    return q_out.transpose(1, 2).reshape(t, -1), k_out.transpose(1, 2).reshape(t, -1)


@pytest.mark.parametrize("name", list(ROPES))
def test_rope_matches_hf(name):
    torch.manual_seed(0)
    q, k = torch.randn(len(POSITIONS), HEADS * HEAD), torch.randn(len(POSITIONS), KV_HEADS * HEAD)
    rope = get_rope(HEAD, MAX_POS, ROPES[name])
    expected_cls = {"default": RotaryEmbedding, "llama3": Llama3RotaryEmbedding,
                    "linear": LinearScalingRotaryEmbedding}[name]
    assert type(rope) is expected_cls
    q_out, k_out = rope(POSITIONS, q, k)
    q_ref, k_ref = hf_rope(ROPES[name], q, k)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


def test_llama3_scaling_changes_only_low_frequencies():
    plain = get_rope(HEAD, MAX_POS, ROPES["default"] | {"rope_theta": 500000.0})
    scaled = get_rope(HEAD, MAX_POS, ROPES["llama3"])
    base, llama3 = plain._compute_inv_freq(500000.0), scaled._compute_inv_freq(500000.0)
    wavelen = 2 * torch.pi / base
    torch.testing.assert_close(llama3[wavelen < 16], base[wavelen < 16])  # high frequencies kept
    torch.testing.assert_close(llama3[wavelen > 64], base[wavelen > 64] / 8)  # low ones slowed 8x
    medium = (wavelen > 16) & (wavelen < 64)
    assert medium.any() and bool(((llama3[medium] < base[medium]) & (llama3[medium] > base[medium] / 8)).all())


def test_gptj_style_rotates_adjacent_pairs():
    rope = get_rope(8, 16, {"rope_theta": 100.0}, is_neox_style=False)
    x = torch.randn(3, 8)
    pos = torch.tensor([0, 4, 9])
    out, _ = rope(pos, x, x)
    # Pair (2i, 2i+1) is the complex number x_2i + j x_2i+1, rotated by pos * theta_i.
    theta = 1.0 / 100.0 ** (torch.arange(0, 8, 2).float() / 8)
    z = torch.complex(x[:, 0::2], x[:, 1::2]) * torch.polar(torch.ones(3, 4), pos[:, None] * theta)
    torch.testing.assert_close(out, torch.stack([z.real, z.imag], -1).flatten(1))


def test_partial_rotary_leaves_the_tail_untouched():
    rope = get_rope(16, 32, {"rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    assert rope.rotary_dim == 8
    x = torch.randn(2, 2 * 16)
    out, _ = rope(torch.tensor([3, 7]), x, x)
    torch.testing.assert_close(out.view(2, 2, 16)[..., 8:], x.view(2, 2, 16)[..., 8:])
    assert not torch.allclose(out.view(2, 2, 16)[..., :8], x.view(2, 2, 16)[..., :8])


def test_get_rope_parameters_reads_both_config_formats():
    new = LlamaConfig(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    assert get_rope_parameters(new)["rope_type"] == "llama3"
    assert get_rope_parameters(new)["rope_theta"] == 5e5

    legacy = SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0},
                             max_position_embeddings=4096)
    assert get_rope_parameters(legacy) == {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}

    legacy_llama3 = SimpleNamespace(rope_theta=5e5, max_position_embeddings=4096, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    assert get_rope_parameters(legacy_llama3)["original_max_position_embeddings"] == 4096

    bare = SimpleNamespace(max_position_embeddings=64)
    assert get_rope_parameters(bare) == {"rope_type": "default", "rope_theta": 10000.0}


def test_unsupported_rope_type_is_a_value_error():
    with pytest.raises(ValueError, match="dynamic.*supported"):
        get_rope(HEAD, MAX_POS, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="factor"):
        get_rope(HEAD, MAX_POS, {"rope_type": "linear"})
