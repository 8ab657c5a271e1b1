"""GGUF -> HF names and values, on tiny GGUF files written the way llama.cpp's converter writes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from pagedllm.loader.gguf_weights import gguf_to_hf_name, gguf_weights_iterator, reverse_permute_qk

Q8_0_TENSORS = frozenset({"blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.ffn_up.weight"})


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=263,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: k is permuted with 2 heads, q with 4
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def test_gguf_to_hf_name() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.3.attn_output.weight") == "model.layers.3.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert gguf_to_hf_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    for unknown in ("blk.0.ffn_gate_exps.weight", "blk.x.attn_q.weight", "mystery.weight"):
        with pytest.raises(ValueError, match="no HF equivalent"):
            gguf_to_hf_name(unknown)


def test_reverse_permute_undoes_llama_cpp_permute(llama_permute: Callable) -> None:
    # one head of dim 4: HF rows [a, b, c, d] are stored as [a, c, b, d]
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert reverse_permute_qk(stored, n_head=1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    restored = reverse_permute_qk(torch.from_numpy(llama_permute(w, 6)), n_head=6)
    assert torch.equal(restored, torch.from_numpy(w))
    with pytest.raises(ValueError, match="heads"):
        reverse_permute_qk(torch.zeros(6, 2), n_head=4)


def test_llama_gguf_round_trip(tmp_path: Path, gguf_writer: Callable) -> None:
    model = tiny_llama()
    state_dict = model.state_dict()
    path = gguf_writer(tmp_path / "tiny-llama.gguf", "llama", state_dict, model.config, True, Q8_0_TENSORS)

    loaded = dict(gguf_weights_iterator(path, model.config, use_tqdm=False))
    assert set(loaded) == set(state_dict)
    for name, ref in state_dict.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        if any(
            f"layers.1.{part}." in name for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")
        ):
            # Q8_0: 8 bits per value, one scale per 32 values: error <= scale / 2 = max|block| / 254
            torch.testing.assert_close(got, ref, atol=ref.abs().max().item() / 200, rtol=0)
        else:
            assert torch.equal(got, ref), name


def test_qwen3_gguf_is_not_unpermuted(tmp_path: Path, gguf_writer: Callable) -> None:
    # llama.cpp stores Qwen2/Qwen3 q/k as they are (NeoX rope); un-permuting them would scramble heads.
    config = Qwen3Config(
        vocab_size=263,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    state_dict = Qwen3ForCausalLM(config).state_dict()
    state_dict.pop("lm_head.weight")  # tied: llama.cpp writes no output.weight
    path = gguf_writer(tmp_path / "tiny-qwen3.gguf", "qwen3", state_dict, config, False)

    loaded = dict(gguf_weights_iterator(path, config, use_tqdm=False))
    assert set(loaded) == set(state_dict)
    assert "model.layers.0.self_attn.q_norm.weight" in loaded
    for name, ref in state_dict.items():
        assert torch.equal(loaded[name], ref), name
