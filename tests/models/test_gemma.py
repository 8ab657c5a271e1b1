"""Gemma 2 and Gemma 3 (text): greedy tokens equal transformers' (fp32, CPU, tiny random models)."""

from __future__ import annotations

from greedy_check import TINY, check_greedy_matches_transformers
from transformers import Gemma2Config, Gemma3TextConfig


def test_gemma2_greedy_matches_transformers():
    # Layers alternate sliding (window 6) and global; both soft-caps on; scalar != head_dim.
    config = Gemma2Config(**TINY, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
                          attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                          architectures=["Gemma2ForCausalLM"])
    assert config.layer_types == ["sliding_attention", "full_attention"]
    check_greedy_matches_transformers(config, seed=6, attn_implementation="eager")


def test_gemma3_text_greedy_matches_transformers():
    # Three layers, the third global (pattern 3); local rope base 10 000 vs global 1e6 with linear scaling.
    config = Gemma3TextConfig(**dict(TINY, num_hidden_layers=3), head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=5, sliding_window_pattern=3,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 1e6}},
                              architectures=["Gemma3ForCausalLM"])
    assert config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    check_greedy_matches_transformers(config, seed=7, attn_implementation="eager")
