"""Tiny GGUF files written the way llama.cpp's converter writes them, for fast loader tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import PretrainedConfig

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "o r", "Ġ w"]
SAMPLING = {"general.sampling.temp": 0.7, "general.sampling.top_k": 7}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py), written from its definition."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def byte_level_vocab() -> list[str]:
    """GPT-2 byte-level BPE vocabulary: 3 specials, the 256 byte symbols, one token per merge."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:  # bytes without a printable glyph map to 256, 257, ...
            symbols[b] = chr(256 + extra)
            extra += 1
    return SPECIAL_TOKENS + [symbols[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES]


TINY_VOCAB_SIZE = len(byte_level_vocab())  # 263


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


def write_llama_cpp_header(writer: gguf.GGUFWriter, config) -> None:
    """The hparams and byte-level BPE tokenizer (with chat template) llama.cpp's converter writes."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    tokens = byte_level_vocab()
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(
    path: Path,
    arch: str,
    state_dict: dict[str, torch.Tensor],
    config: PretrainedConfig,
    permute: bool,
    quantized: frozenset[str] = frozenset(),
) -> Path:
    """Write `state_dict` as llama.cpp would: hparams, a byte-level BPE tokenizer with a chat template,
    sampling defaults, GGUF tensor names, q/k rows permuted (if `permute`), the `quantized` ones Q8_0."""
    gguf_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    writer = gguf.GGUFWriter(path, arch)
    write_llama_cpp_header(writer, config)
    writer.add_float32("general.sampling.temp", SAMPLING["general.sampling.temp"])
    writer.add_int32("general.sampling.top_k", SAMPLING["general.sampling.top_k"])

    for gguf_name, hf_name in hf_to_gguf_names(gguf_arch, config.num_hidden_layers, list(state_dict)).items():
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
    return path


@pytest.fixture
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point pagedllm's cache at an empty directory, so the slow build paths run."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(root))
    return root


@pytest.fixture
def gguf_writer() -> Callable[..., Path]:
    return write_gguf


@pytest.fixture
def llama_permute() -> Callable[[np.ndarray, int], np.ndarray]:
    return llama_cpp_permute
