"""`quantization="gguf"` on the CPU with tiny GGUF files whose weights are Q4_1 / Q4_0 / Q8_0 blocks.

The model computes on the blocks (no dense copy of a linear weight), and its greedy tokens and
logprobs equal the dense float32 path's (the same float32 weight values; only sums are reordered)
and transformers' own GGUF load; fused and tied layers, untied LM heads and long prefills included.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.cpu.build import load_cpu_kernels
from pagedllm.loader import model_loader
from pagedllm.quantization.gguf import GGUFEmbeddingMethod, GGUFLinearMethod
from tests.loader.conftest import hf_to_gguf_names, llama_cpp_permute, write_llama_cpp_header
from tests.utils import assert_pool_idle

PROMPTS = [[5, 80, 81, 200], [7] * 40, [100, 101, 102, 103, 104, 105, 1, 2], list(range(10, 90))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)


def write_quantized_gguf(path: Path, model: LlamaForCausalLM, layer_type: str, embed_type: str) -> Path:
    """Like llama.cpp's converter: q/k rows permuted, projections `layer_type`, embedding (and output)
    `embed_type`, norms float32, a byte-level BPE tokenizer."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    write_llama_cpp_header(writer, config)
    state = {k: v for k, v in model.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    for gguf_name, hf_name in hf_to_gguf_names(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers, list(state)).items():
        array = state[hf_name].float().numpy()
        if ".attn_q." in gguf_name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif ".attn_k." in gguf_name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        qtype = embed_type if gguf_name in ("token_embd.weight", "output.weight") else layer_type
        if array.ndim == 2 and qtype != "F32":
            t = gguf.GGMLQuantizationType[qtype]
            data = gguf.quants.quantize(array, t)
            writer.add_tensor(gguf_name, data, raw_shape=data.shape, raw_dtype=t)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def kernels():
    if load_cpu_kernels() is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")


@pytest.fixture(scope="module", params=[("Q4_1", "Q8_0", True), ("Q4_0", "Q8_0", False), ("Q8_0", "Q4_1", False)],
                ids=["q4_1-tied", "q4_0-untied", "q8_0-untied-q4_1-head"])
def tiny_gguf(request, tmp_path_factory, kernels) -> Path:
    layer_type, embed_type, tied = request.param
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=263, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # a spread of logits, so greedy picks are not near-ties of a flat model
        model.lm_head.weight.mul_(20) if not tied else model.model.embed_tokens.weight.mul_(20)
    return write_quantized_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, layer_type, embed_type)


def generate(path: Path, **kw):
    llm = LLM(str(path), max_model_len=256, num_gpu_blocks_override=64, enable_prefix_caching=False, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_pool_idle(llm)
    return llm, outs


def test_blocks_match_dense_float32_path(tiny_gguf, monkeypatch):
    llm, outs = generate(tiny_gguf)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model
    linears = [m for m in model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all(not hasattr(m, "weight") and not hasattr(m, "qweight") for m in linears)
    assert isinstance(model.lm_head.quant_method, GGUFEmbeddingMethod)
    assert model.lm_head.quant_method.packed is not None

    monkeypatch.setattr(model_loader, "get_quant_config", lambda *a: None)
    _, dense = generate(tiny_gguf)
    for o, d in zip(outs, dense):
        assert o.outputs[0].token_ids == d.outputs[0].token_ids
        for lp, dlp in zip(o.outputs[0].logprobs, d.outputs[0].logprobs):
            for tok, entry in dlp.items():
                assert abs(lp[tok].logprob - entry.logprob) < 1e-4


def test_long_prefill_and_transformers_reference(tiny_gguf):
    """A 200-token prompt takes the dequantize + BLAS path (over 64 rows); transformers dequantizes the
    same file to float32 and must pick the same greedy tokens."""
    prompt = [(i * 37) % 250 + 3 for i in range(200)]
    llm = LLM(str(tiny_gguf), max_model_len=256, num_gpu_blocks_override=64)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name,
                                                           dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.outputs[0].token_ids == ref
