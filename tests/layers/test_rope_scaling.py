"""YaRN and LongRoPE cos/sin caches equal transformers' rope init functions (inv_freq and attention factor)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedllm.layers.rotary_embedding import get_rope, get_rope_parameters


def _hf_cache(config, positions: int, rope_type: str, **kw) -> torch.Tensor:
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kw)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], -1) * attention_factor


@pytest.mark.parametrize("config, head_dim", [
    # Qwen2.5's long-context recipe: yarn factor 4 over 32K (scaled down).
    (Qwen2Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=512,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                  "original_max_position_embeddings": 128}), 16),
    # DeepSeek-V2: yarn with mscale / mscale_all_dim and its own beta values, on the 8-wide rope part.
    (DeepseekV2Config(hidden_size=64, num_attention_heads=4, qk_rope_head_dim=8, qk_nope_head_dim=16,
                      max_position_embeddings=512,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32,
                                       "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                       "original_max_position_embeddings": 64}), 8),
])
def test_yarn_matches_transformers(config, head_dim):
    rope = get_rope(head_dim, config.max_position_embeddings, get_rope_parameters(config))
    if isinstance(config, DeepseekV2Config):
        config.head_dim = head_dim  # transformers reads the rope width from head_dim
    torch.testing.assert_close(rope.cos_sin_cache, _hf_cache(config, config.max_position_embeddings, "yarn"))
