"""Qwen3 (q_norm/k_norm per head, head_dim from config != hidden / heads) matches HF transformers."""

from __future__ import annotations

from hf_compare import TINY, make_hf_model, make_paged_model
from test_llama import check_batched_prefill_then_decode, check_chunked_prefill
from transformers import PretrainedConfig, Qwen3Config


def qwen3_config(tie: bool = False) -> PretrainedConfig:
    # head_dim 32 with 4 heads: q is 128 wide while hidden is 64, as in real Qwen3 checkpoints.
    return Qwen3Config(**TINY, head_dim=32, architectures=["Qwen3ForCausalLM"], tie_word_embeddings=tie,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def test_qwen3_batched_prefill_then_decode_matches_hf() -> None:
    check_batched_prefill_then_decode(qwen3_config(), seed=3)


def test_qwen3_chunked_prefill_matches_hf() -> None:
    check_chunked_prefill(qwen3_config(tie=True), seed=4)


def test_qwen3_shapes_follow_config_head_dim() -> None:
    config = qwen3_config()
    attn = make_paged_model(config, make_hf_model(config)).model.layers[0].self_attn
    assert attn.head_dim == 32
    assert attn.qkv_proj.weight.shape == ((4 + 2 * 2) * 32, 64)
    assert attn.o_proj.weight.shape == (64, 4 * 32)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (32,)
