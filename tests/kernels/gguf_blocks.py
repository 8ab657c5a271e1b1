"""Random valid GGUF blocks for tests: gguf.quants.quantize of random floats where gguf-py can quantize
the type (Q4_0 / Q4_1 / Q8_0), else random bytes with finite fp16 scales set to `scale` (Q4_K, Q5_K,
Q6_K: gguf-py only dequantizes those). Values come out about N(0, std). `write_random_llama_gguf`: a
Llama GGUF of such blocks (tests/quantization/test_gguf_gpu_method.py, scripts/gpu_gguf_check.py)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# fp16 d giving weights of standard deviation ~1 for random K-quant bytes (see `random_gguf_blocks`)
_UNIT_D = {"Q4_K": 1 / 200, "Q5_K": 1 / 400, "Q6_K": 1 / 1300}


def random_gguf_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, std: float = 1.0) -> np.ndarray:
    """(rows, bytes) uint8 blocks of `qtype` holding a rows x cols weight."""
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        return gguf.quants.quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), t)
    qk, nbytes = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, (rows, cols // qk, nbytes), dtype=np.uint8)
    d = (_UNIT_D[qtype] * std * (0.5 + rng.random((rows, cols // qk)))).astype(np.float16)
    d = d.view(np.uint8).reshape(rows, cols // qk, 2)
    if qtype == "Q6_K":  # ql, qh, 16 int8 scales, then d
        raw[..., 208:210] = d
    else:  # Q4_K / Q5_K: d, dmin first; dmin = 7.5 d (Q5_K 15.5 d) centres w = d sc q - dmin mn near 0
        raw[..., 0:2] = d
        raw[..., 2:4] = (d.view(np.float16) * (7.5 if qtype == "Q4_K" else 15.5)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


_PROJ_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def write_random_llama_gguf(path: Path, config, layer_types: list[tuple], rng: np.random.Generator,
                            std: float = 0.06, head_type: str = "F32") -> Path:
    """A Llama GGUF (llama.cpp's names and tokenizer header) with random weights: layer i's (q/k/v, o,
    gate/up, down) projections as blocks of layer_types[i] (an entry is one type, or a tuple of one per
    projection of the group: ("Q4_K", "Q4_K", "Q6_K") for q, k, v as Q4_K_M files have them), norms
    ~1, embedding float32, LM head (untied; weights ~N(0, 0.3) for a spread of logits) `head_type`."""
    from tests.loader.conftest import hf_to_gguf_names, write_llama_cpp_header

    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    shapes = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                   p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    writer = gguf.GGUFWriter(path, "llama")
    write_llama_cpp_header(writer, config)
    for gguf_name, hf_name in hf_to_gguf_names(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers, list(shapes)).items():
        shape = shapes[hf_name]
        if len(shape) == 1:
            writer.add_tensor(gguf_name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif hf_name.startswith("model.layers."):
            types = layer_types[int(hf_name.split(".")[2])]
            group, qtype = next((g, t) for t, g in zip(types, _PROJ_GROUPS) if any(f".{p}." in hf_name for p in g))
            if not isinstance(qtype, str):  # one type per projection of the group, e.g. q, k Q4_K and v Q6_K
                qtype = qtype[next(i for i, p in enumerate(group) if f".{p}." in hf_name)]
            data = random_gguf_blocks(qtype, *shape, rng, std=std)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif hf_name == "lm_head.weight" and head_type != "F32":
            data = random_gguf_blocks(head_type, *shape, rng, std=0.3)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[head_type])
        else:
            scale = 0.3 if hf_name == "lm_head.weight" else 1.0
            writer.add_tensor(gguf_name, (scale * rng.standard_normal(shape)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
