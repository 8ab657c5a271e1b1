"""The GGUF GPU method (quantization/gguf_gpu.py) end to end, forced onto the CPU where its `apply` is
the fp32 torch reference: a tiny Llama GGUF mixing Q4_K / Q6_K (as Q4_K_M files do) with Q4_0 / Q4_1 /
Q8_0 (a fused qkv of Q4_K q/k and Q6_K v included), a Q6_K LM head, and one Q5_K tensor (no kernel:
dense). Greedy tokens and logprobs equal the dense-dequantized
model's; the layers keep only their repacked blocks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.loader import model_loader
from pagedllm.loader.gguf_weights import gguf_tensor_types
from pagedllm.quantization.gguf import GGUFConfig, select_gguf_config
from pagedllm.quantization.gguf_gpu import GGUFGPULinearMethod
from tests.kernels.gguf_blocks import write_random_llama_gguf

PROMPTS = [[5, 80, 81, 200], [7] * 30, list(range(10, 60))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
# per layer: (q/k/v, o, gate/up, down) types; layer 1's down is Q5_K, which has no kernel;
# layer 0's v_proj is Q6_K beside Q4_K q/k (as in Q4_K_M files): a fused layer of mixed types
LAYER_TYPES = [(("Q4_K", "Q4_K", "Q6_K"), "Q6_K", "Q4_K", "Q6_K"), ("Q4_0", "Q8_0", "Q4_1", "Q5_K")]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> Path:
    config = LlamaConfig(vocab_size=263, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    return write_random_llama_gguf(tmp_path_factory.mktemp("gguf_gpu") / "mixed.gguf", config, LAYER_TYPES,
                                   np.random.default_rng(0), head_type="Q6_K")


def _generate(path: Path):
    llm = LLM(str(path), max_model_len=128, num_gpu_blocks_override=32, enable_prefix_caching=False)
    return llm, llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)


def test_gpu_method_matches_dense(mixed_gguf, monkeypatch):
    # The real selection takes the GPU method on CUDA in bf16 / fp16 (decided from the file alone, so
    # checkable here); on the CPU it keeps its own choice.
    assert select_gguf_config(_model_config(mixed_gguf, "bfloat16"), torch.device("cuda")).gpu
    assert not getattr(select_gguf_config(_model_config(mixed_gguf, "float32"), torch.device("cpu")), "gpu", False)
    assert select_gguf_config(_model_config(mixed_gguf, "bfloat16"), torch.device("cpu")) is None  # dense
    forced = GGUFConfig(gguf_tensor_types(mixed_gguf), gpu=True)
    monkeypatch.setattr(model_loader, "get_quant_config", lambda *a: forced)
    llm, outs = _generate(mixed_gguf)
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model
    methods = {name: m.quant_method for name, m in model.named_modules() if hasattr(m, "quant_method")}
    gpu = {n: m.qtype for n, m in methods.items() if isinstance(m, GGUFGPULinearMethod)}
    assert gpu == {"model.layers.0.self_attn.qkv_proj": "Q4_K/Q6_K", "model.layers.0.self_attn.o_proj": "Q6_K",
                   "model.layers.0.mlp.gate_up_proj": "Q4_K", "model.layers.0.mlp.down_proj": "Q6_K",
                   "model.layers.1.self_attn.qkv_proj": "Q4_0", "model.layers.1.self_attn.o_proj": "Q8_0",
                   "model.layers.1.mlp.gate_up_proj": "Q4_1", "lm_head": "Q6_K"}  # untied head on blocks
    for name in gpu:  # only the repacked blocks: no dense weight, no raw bytes
        layer = model.get_submodule(name)
        assert not hasattr(layer, "weight") and not hasattr(layer, "qweight")
        assert [p.qtype for p in layer.gguf_packed] == gpu[name].split("/")
    assert hasattr(model.get_submodule("model.layers.1.mlp.down_proj"), "weight")  # Q5_K: dense

    monkeypatch.setattr(model_loader, "get_quant_config", lambda *a: None)
    _, dense = _generate(mixed_gguf)
    for o, d in zip(outs, dense):
        assert o.outputs[0].token_ids == d.outputs[0].token_ids
        assert len(set(d.outputs[0].token_ids)) > 2  # not a degenerate model repeating one token
        for lp, dlp in zip(o.outputs[0].logprobs, d.outputs[0].logprobs):
            for tok, entry in dlp.items():
                assert abs(lp[tok].logprob - entry.logprob) < 1e-3


def _model_config(path: Path, dtype: str):
    from pagedllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(path), max_model_len=128, dtype=dtype).create_engine_config().model_config
