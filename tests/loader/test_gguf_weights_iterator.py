"""GGUF -> HF names and values, on a tiny GGUF written here the way llama.cpp's converter writes one."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from pagedllm.loader.gguf_weights import gguf_to_hf_name, gguf_weights_iterator, reverse_permute_qk


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), written from its definition."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def hf_to_gguf_names(arch: gguf.MODEL_ARCH, num_layers: int, hf_names: list[str]) -> dict[str, str]:
    """{gguf_name: hf_name} from gguf-py's own HF->GGUF table (the one llama.cpp's converter uses)."""
    table = gguf.get_tensor_name_map(arch, num_layers)
    out = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = table.get_name(base)
        assert gguf_base is not None, hf_name
        out[f"{gguf_base}.{suffix}"] = hf_name
    return out


def tiny_llama_config(**overrides) -> LlamaConfig:
    kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: k is permuted with 2 heads, q with 4
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def write_gguf(
    path: Path,
    arch: str,
    state_dict: dict[str, torch.Tensor],
    config,
    permute: bool,
    quantized: frozenset[str] = frozenset(),
) -> None:
    """Write `state_dict` as llama.cpp would: GGUF names, q/k permuted (if `permute`), some tensors Q8_0."""
    gguf_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    names = hf_to_gguf_names(gguf_arch, config.num_hidden_layers, list(state_dict))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    for gguf_name, hf_name in names.items():
        array = state_dict[hf_name].float().numpy()
        if permute and ".attn_q." in gguf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif permute and ".attn_k." in gguf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        if gguf_name in quantized:
            qtype = gguf.GGMLQuantizationType.Q8_0
            data = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


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


def test_reverse_permute_undoes_llama_cpp_permute() -> None:
    # one head of dim 4: HF rows [a, b, c, d] are stored as [a, c, b, d]
    stored = torch.tensor([[0.0], [2.0], [1.0], [3.0]])
    assert reverse_permute_qk(stored, n_head=1).flatten().tolist() == [0.0, 1.0, 2.0, 3.0]
    w = np.random.default_rng(0).standard_normal((6 * 8, 5)).astype(np.float32)
    restored = reverse_permute_qk(torch.from_numpy(llama_cpp_permute(w, 6)), n_head=6)
    assert torch.equal(restored, torch.from_numpy(w))
    with pytest.raises(ValueError, match="heads"):
        reverse_permute_qk(torch.zeros(6, 2), n_head=4)


def test_llama_gguf_round_trip(tmp_path: Path) -> None:
    config = tiny_llama_config()
    torch.manual_seed(0)
    state_dict = LlamaForCausalLM(config).state_dict()
    quantized = frozenset({"blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.ffn_up.weight"})
    path = tmp_path / "tiny-llama.gguf"
    write_gguf(path, "llama", state_dict, config, permute=True, quantized=quantized)

    loaded = dict(gguf_weights_iterator(path, config, use_tqdm=False))
    assert set(loaded) == set(state_dict)
    for name, ref in state_dict.items():
        got = loaded[name]
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        if (
            "layers.1.self_attn.q_proj" in name
            or "layers.1.self_attn.k_proj" in name
            or "layers.1.mlp.up" in name
        ):
            # Q8_0: 8-bit per value with one scale per 32 -> error <= scale / 2 = max|block| / 254
            torch.testing.assert_close(got, ref, atol=ref.abs().max().item() / 200, rtol=0)
        else:
            assert torch.equal(got, ref), name


def test_qwen3_gguf_is_not_unpermuted(tmp_path: Path) -> None:
    # llama.cpp stores Qwen2/Qwen3 q/k as is (NeoX rope); un-permuting them would scramble the heads.
    from transformers import Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=320,
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
    path = tmp_path / "tiny-qwen3.gguf"
    write_gguf(path, "qwen3", state_dict, config, permute=False)

    loaded = dict(gguf_weights_iterator(path, config, use_tqdm=False))
    assert set(loaded) == set(state_dict)
    assert "model.layers.0.self_attn.q_norm.weight" in loaded
    for name, ref in state_dict.items():
        assert torch.equal(loaded[name], ref), name
