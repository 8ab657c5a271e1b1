"""DeepSeek V2 / V3 (MLA with the latent in the paged cache, routed + shared experts): greedy tokens
equal transformers' (fp32, CPU, tiny random models)."""

from __future__ import annotations

from greedy_check import TINY, check_greedy_matches_transformers
from transformers import DeepseekV2Config, DeepseekV3Config

MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32,
           n_shared_experts=1, first_k_dense_replace=1, num_experts_per_tok=2)


def test_deepseek_v2_greedy_matches_transformers():
    # V2-Lite style: no q_lora, softmax routing over 4 groups (2 kept), scaled, YaRN with mscale.
    config = DeepseekV2Config(**dict(TINY, num_key_value_heads=4), **MLA, q_lora_rank=None, n_routed_experts=8,
                              topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False,
                              routed_scaling_factor=1.5,
                              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                               "mscale": 0.707, "mscale_all_dim": 0.707,
                                               "original_max_position_embeddings": 64, "beta_fast": 32,
                                               "beta_slow": 1},
                              architectures=["DeepseekV2ForCausalLM"])
    check_greedy_matches_transformers(config, seed=9)


def test_deepseek_v3_greedy_matches_transformers():
    # V3 style: q_lora, sigmoid routing with the correction bias, noaux_tc groups, renormalised.
    config = DeepseekV3Config(**dict(TINY, num_key_value_heads=4), **MLA, q_lora_rank=24, n_routed_experts=8,
                              n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                              architectures=["DeepseekV3ForCausalLM"])
    check_greedy_matches_transformers(config, seed=10)


def test_cache_holds_one_latent_per_token(tmp_path):
    from pagedllm.attention.mla import MLAAttention
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.worker.kv_cache import kv_cache_bytes_per_block

    config = DeepseekV2Config(**dict(TINY, num_key_value_heads=4), **MLA, q_lora_rank=None, n_routed_experts=4,
                              architectures=["DeepseekV2ForCausalLM"])
    config.save_pretrained(tmp_path)
    engine_config = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, block_size=4,
                               load_format="dummy").create_engine_config()
    # 2 layers x 4 slots x (32 latent + 8 rope) x 4 bytes, not 2 x heads x head_dim per layer.
    assert kv_cache_bytes_per_block(engine_config) == 2 * 4 * 40 * 4
    attn = MLAAttention(4, 32, 8, 0.1)
    assert attn.kv_cache_shape(10, 4) == (1, 10, 4, 1, 40)
