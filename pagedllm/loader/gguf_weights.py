"""GGUF file -> (HF tensor name, float32 tensor), dequantized, for `model.load_weights`.

llama.cpp renames every tensor and, for Llama-family models, permutes the rows of the q/k projections;
both are undone here so the model sees exactly what an HF checkpoint holds:

    token_embd.weight         -> model.embed_tokens.weight      (vocab, hidden)
    blk.3.attn_q.weight       -> model.layers.3.self_attn.q_proj.weight  (rows un-permuted)
    blk.3.ffn_down.weight     -> model.layers.3.mlp.down_proj.weight
    output_norm.weight        -> model.norm.weight
    output.weight             -> lm_head.weight                 (absent when embeddings are tied)
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import dequantize
from tqdm.auto import tqdm

from pagedllm.loader.gguf_reader import open_gguf, read_field

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",  # Qwen3
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Tensors llama.cpp adds that HF checkpoints do not have. rope_freqs: Llama-3.1's rope scaling
# factors, which the model recomputes from `config.rope_parameters`.
_SKIPPED_NAMES = frozenset({"rope_freqs.weight"})
# Architectures whose q/k rows llama.cpp's converter permutes (`LlamaModel.permute` in
# convert_hf_to_gguf.py); transformers' GGUF loader un-permutes the same set (its `TENSOR_PROCESSORS`).
# Qwen2/Qwen3 use the NeoX rope layout already and are stored as is.
_ROPE_PERMUTED_ARCHS = frozenset({"llama"})

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor; None for tensors HF does not keep; ValueError if unknown.

    "blk.0.attn_k.weight" -> "model.layers.0.self_attn.k_proj.weight"
    """
    if gguf_name in _SKIPPED_NAMES:
        return None
    if match := _BLOCK_RE.match(gguf_name):
        layer, part, kind = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
            return f"{_TOP_LEVEL_NAMES[base]}.{kind}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no HF equivalent known to pagedllm; this GGUF architecture is "
        "not supported (supported: dense Llama/Mistral/Qwen2/Qwen3-style decoders)."
    )


def reverse_permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rotate-half layout -> HF layout).

    llama.cpp: w.reshape(n_head, 2, d, ...).swapaxes(1, 2): per head, rows [r0..r_{d-1}, i0..i_{d-1}]
    become interleaved [r0, i0, r1, i1, ...]. Inverse: view rows as (n_head, d, 2, ...), swap back.
    Example, one head, head_dim 4: stored rows [a, c, b, d] -> HF rows [a, b, c, d].
    """
    rows = weight.shape[0]
    if rows % (2 * n_head) != 0:
        raise ValueError(f"q/k tensor with {rows} rows cannot be split into {n_head} heads of even size")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """HF weight name -> GGML type name ("Q4_1", "Q8_0", "F32", ...) of every tensor in the file."""
    reader = open_gguf(path)
    types = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is not None:
            types[hf_name] = tensor.tensor_type.name
    return types


def gguf_weights_iterator(
    path: Path,
    hf_config: PretrainedConfig,
    use_tqdm: bool = True,
    keep_quantized: Container[str] = (),
    skip_dense: Container[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 CPU tensor in HF shape) for every tensor of the GGUF file at `path`.

    One tensor is dequantized at a time, so peak memory is the file's mmap plus one float32 tensor.
    For the names in `keep_quantized` the raw blocks are yielded too, as (name with ".weight" ->
    ".qweight", uint8 (rows, bytes per row)), rows in the same HF order (q/k un-permuted): a
    quantization method that computes on the blocks loads them (quantization/gguf.py). Names in
    `skip_dense` are neither dequantized nor yielded as float32.
    """
    reader = open_gguf(path)
    arch = read_field(reader, "general.architecture")
    permute = arch in _ROPE_PERMUTED_ARCHS
    num_heads = hf_config.num_attention_heads
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads

    for tensor in tqdm(reader.tensors, desc="Dequantizing GGUF tensors", disable=not use_tqdm):
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        # GGUF dims are stored fastest-first: shape [in, out] <-> HF (out, in).
        hf_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if hf_name in keep_quantized:
            # Quantized tensors are (rows, bytes per row) uint8 views of the mmap: rows are HF's
            # output rows, so the same row un-permutation applies to whole rows of blocks.
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
            if raw.dim() != 2 or raw.shape[0] != hf_shape[0]:
                raise ValueError(f"GGUF tensor {tensor.name} ({tensor.tensor_type.name}) is not stored as "
                                 f"{hf_shape[0]} rows of blocks; got {tuple(raw.shape)}")
            yield hf_name.removesuffix(".weight") + ".qweight", _unpermute(raw, hf_name, permute, num_heads,
                                                                            num_kv_heads)
        if hf_name in skip_dense:
            continue
        # dequantize: quantized blocks (rows, bytes) -> float32 (rows, cols); numpy order = HF (out, in).
        array = dequantize(tensor.data, tensor.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable:
            # F32 tensors come back as read-only views of the mmap; torch wants its own writable memory.
            array = array.astype(np.float32)
        weight = torch.from_numpy(array)
        if tuple(weight.shape) != hf_shape:
            weight = weight.reshape(hf_shape)
        yield hf_name, _unpermute(weight, hf_name, permute, num_heads, num_kv_heads)


def _unpermute(weight: torch.Tensor, hf_name: str, permute: bool, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    if permute and ".self_attn.q_proj." in hf_name:
        return reverse_permute_qk(weight, num_heads)
    if permute and ".self_attn.k_proj." in hf_name:
        return reverse_permute_qk(weight, num_kv_heads)
    return weight
