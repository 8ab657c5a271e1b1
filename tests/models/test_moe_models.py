"""Mixtral, Qwen2-MoE and Qwen3-MoE: greedy tokens equal transformers' (fp32, CPU, tiny random models)."""

from __future__ import annotations

from greedy_check import TINY, check_greedy_matches_transformers
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig


def test_mixtral_greedy_matches_transformers():
    config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    check_greedy_matches_transformers(config, seed=1)


def test_qwen2_moe_greedy_matches_transformers():
    # Layer 0 dense (mlp_only_layers), layer 1 sparse with a shared expert; top-k not renormalised.
    config = Qwen2MoeConfig(**TINY, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[0],
                            architectures=["Qwen2MoeForCausalLM"])
    check_greedy_matches_transformers(config, seed=2)


def test_qwen3_moe_greedy_matches_transformers():
    config = Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                            norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    check_greedy_matches_transformers(config, seed=3)
