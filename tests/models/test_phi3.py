"""Phi-3: fused qkv / gate_up checkpoint tensors and LongRoPE; greedy tokens equal transformers'."""

from __future__ import annotations

import math

import torch
from greedy_check import TINY, check_greedy_matches_transformers
from transformers import Phi3Config

from pagedllm.layers.rotary_embedding import get_rope, get_rope_parameters


def longrope_config() -> Phi3Config:
    # head_dim 16 -> 8 frequencies; pretraining length 128 of 256: attention factor sqrt(1 + ln 2 / ln 128).
    g = torch.Generator().manual_seed(0)
    short = (1 + torch.rand(8, generator=g)).tolist()
    long = (1 + 4 * torch.rand(8, generator=g)).tolist()
    return Phi3Config(**TINY, original_max_position_embeddings=128, pad_token_id=0,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                       "long_factor": long},
                      architectures=["Phi3ForCausalLM"])


def test_phi3_longrope_greedy_matches_transformers():
    check_greedy_matches_transformers(longrope_config(), seed=8)


def test_longrope_cache_switches_factors_at_the_pretraining_length():
    config = longrope_config()
    params = get_rope_parameters(config)
    rope = get_rope(16, 256, params)
    mscale = math.sqrt(1 + math.log(2) / math.log(128))
    assert math.isclose(rope.attention_factor, mscale, rel_tol=1e-6)
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    for pos, factors in ((127, params["short_factor"]), (128, params["long_factor"])):
        angles = pos * inv / torch.tensor(factors)
        torch.testing.assert_close(rope.cos_sin_cache[pos], torch.cat([angles.cos(), angles.sin()]) * mscale)
