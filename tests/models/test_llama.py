"""Llama-family models (Llama 3.1 rope, Mistral, Qwen2, tied embeddings) match HF transformers.

Every case: fp32 on CPU, HF weights loaded through `load_weights`, logits within 1e-4 of HF's for
(a) three prompts prefilled in one flat batch, (b) batched decode steps after them, (c) a prompt
split into two prefill chunks (the second batched with another request's prefill).
"""

from __future__ import annotations

import pytest
import torch
from hf_compare import TINY, PagedRunner, hf_logits, make_hf_model, make_paged_model
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config

ATOL = 1e-4

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def llama3_config() -> PretrainedConfig:
    return LlamaConfig(**TINY, architectures=["LlamaForCausalLM"], rope_parameters=LLAMA3_ROPE)


def mistral_config() -> PretrainedConfig:
    return MistralConfig(**TINY, head_dim=16, architectures=["MistralForCausalLM"],
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def qwen2_config() -> PretrainedConfig:
    return Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"],
                       rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})


def tied_llama_config() -> PretrainedConfig:
    # SmolLM2-style: tied embeddings, a single KV head (MQA).
    cfg = dict(TINY, num_key_value_heads=1)
    return LlamaConfig(**cfg, architectures=["LlamaForCausalLM"], tie_word_embeddings=True)


CONFIGS = {"llama3": llama3_config, "mistral": mistral_config, "qwen2": qwen2_config,
           "llama_tied": tied_llama_config}


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_batched_prefill_then_decode(config: PretrainedConfig, seed: int = 0) -> None:
    hf = make_hf_model(config, seed)
    runner = PagedRunner(make_paged_model(config, hf), seed=seed)
    prompts = {"a": random_tokens(5, 1), "b": random_tokens(9, 2), "c": random_tokens(3, 3)}

    # (a) all three prompts in one flat batch of 17 tokens.
    out = runner.step(prompts)
    for req, logits in out.items():
        torch.testing.assert_close(logits, hf_logits(hf, prompts[req]), atol=ATOL, rtol=0)

    # (b) decode steps, all three requests batched; feed back each request's greedy token.
    seqs = {req: list(p) for req, p in prompts.items()}
    for _ in range(3):
        step = {req: [int(logits[-1].argmax())] for req, logits in out.items()}
        out = runner.step(step)
        for req, logits in out.items():
            seqs[req] += step[req]
            assert logits.shape == (1, TINY["vocab_size"])
            torch.testing.assert_close(logits[0], hf_logits(hf, seqs[req])[-1], atol=ATOL, rtol=0)


def check_chunked_prefill(config: PretrainedConfig, seed: int = 0) -> None:
    hf = make_hf_model(config, seed)
    runner = PagedRunner(make_paged_model(config, hf), seed=seed + 7)
    prompt, other = random_tokens(11, 4), random_tokens(4, 5)
    ref = hf_logits(hf, prompt)
    first = runner.step({"a": prompt[:6]})["a"]
    out = runner.step({"a": prompt[6:], "b": other})  # second chunk next to a fresh prefill
    torch.testing.assert_close(first, ref[:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["a"], ref[6:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["b"], hf_logits(hf, other), atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_prefill_then_decode_matches_hf(name: str) -> None:
    check_batched_prefill_then_decode(CONFIGS[name]())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunked_prefill_matches_hf(name: str) -> None:
    check_chunked_prefill(CONFIGS[name]())


def test_tied_head_shares_the_embedding() -> None:
    config = tied_llama_config()
    model = make_paged_model(config, make_hf_model(config))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_qwen2_has_qkv_bias_only() -> None:
    config = qwen2_config()
    model = make_paged_model(config, make_hf_model(config))
    attn = model.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None


def test_load_weights_reports_missing_unexpected_and_partial() -> None:
    config = llama3_config()
    hf_state = make_hf_model(config).state_dict()
    model_cls = type(make_paged_model(config, make_hf_model(config)))

    missing = {k: v for k, v in hf_state.items() if k != "model.layers.1.post_attention_layernorm.weight"}
    with pytest.raises(ValueError, match="post_attention_layernorm"):
        model_cls(config).load_weights(missing.items())

    no_v = {k: v for k, v in hf_state.items() if k != "model.layers.0.self_attn.v_proj.weight"}
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.qkv_proj\.weight"):
        model_cls(config).load_weights(no_v.items())

    extra = dict(hf_state, **{"model.layers.0.mlp.extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="extra"):
        model_cls(config).load_weights(extra.items())

    wrong_shape = dict(hf_state, **{"model.norm.weight": torch.ones(63)})
    with pytest.raises(ValueError, match="shape"):
        model_cls(config).load_weights(wrong_shape.items())


def test_load_weights_skips_rotary_inv_freq_and_returns_names() -> None:
    config = llama3_config()
    hf_state = make_hf_model(config).state_dict()
    hf_state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    model = make_paged_model(config, make_hf_model(config))
    loaded = model.load_weights(hf_state.items())
    assert loaded == set(dict(model.named_parameters()))
    assert "model.layers.0.self_attn.qkv_proj.weight" in loaded
