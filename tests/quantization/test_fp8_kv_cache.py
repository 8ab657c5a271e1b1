"""`kv_cache_dtype="fp8"` on the CPU path: the cache is e4m3 (half the blocks' bytes of bf16, a quarter
of fp32), per-tensor scales come from the checkpoint (else 1.0) and fold into attention, and the
embedded SmolLM2's perplexity on real text moves by little (the number is recorded in BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.attention.backend import TorchAttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.model_loader import load_model
from pagedllm.worker.kv_cache import kv_cache_bytes_per_block
from tests.models.hf_compare import PagedRunner
from tests.quantization import quant_ckpt as qc

# Real English text (the opening of the repo's design habits, paraphrased into plain prose).
TEXT = (
    "The engine keeps the key and value vectors of every request in fixed-size blocks of memory, so that a "
    "long conversation does not need one large contiguous buffer. A scheduler decides at every step which "
    "requests run: new prompts are split into chunks, running requests add one token each, and when memory "
    "runs out the newest request is preempted and recomputed later. Because the blocks are shared, two "
    "requests that start with the same system prompt reuse the same cached blocks instead of computing "
    "them twice. The model itself is an ordinary decoder: embeddings, a stack of attention and feed-forward "
    "layers with residual connections and normalization, and a final projection onto the vocabulary. "
    "Quantized weights make each layer smaller, which matters most when a single request is decoding and "
    "every step has to read all of the weights from memory. An eight-bit cache does the same for the keys "
    "and values: twice as many tokens fit in the same memory, and long contexts read half the bytes."
)


def test_fp8_cache_resolves_and_halves_block_bytes():
    config = EngineArgs(model="llama3-8b", load_format="dummy", kv_cache_dtype="fp8").create_engine_config()
    bf16 = EngineArgs(model="llama3-8b", load_format="dummy", kv_cache_dtype="bfloat16").create_engine_config()
    assert kv_cache_bytes_per_block(config) * 2 == kv_cache_bytes_per_block(bf16)
    with pytest.raises(ValueError, match="fp8_e5m2 and int8 KV caches are not built"):
        EngineArgs(model="llama3-8b", load_format="dummy", kv_cache_dtype="fp8_e5m2").create_engine_config()


def _with_kv_scales(src: str, k_scale: float, v_scale: float) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="pagedllm-kvscale-"))
    shutil.copy(Path(src) / "config.json", dst / "config.json")
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for i in range(json.loads((dst / "config.json").read_text())["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k_scale)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _logits(path, cache_dtype, prompt):
    model = load_model(EngineArgs(model=str(path), skip_tokenizer_init=True).create_engine_config().model_config,
                       torch.device("cpu"))
    runner = PagedRunner(model, num_blocks=32, block_size=4)
    for m in model.modules():
        if isinstance(m, Attention):
            m.bind_kv_cache(torch.zeros(2, 32, 4, m.num_kv_heads, m.head_dim).to(cache_dtype), TorchAttentionBackend())
    out = [runner.step({"a": prompt[:9]})["a"], runner.step({"a": prompt[9:]})["a"]]  # the 2nd reads the cache
    return model, torch.cat(out)


def test_checkpoint_scales_fold_into_attention():
    path, _ = qc.fidelity_model()
    prompt = list(range(3, 23))
    _, exact = _logits(path, torch.float32, prompt)
    _, fp8 = _logits(path, torch.float8_e4m3fn, prompt)
    scaled_path = _with_kv_scales(path, 0.05, 0.02)
    model, scaled = _logits(scaled_path, torch.float8_e4m3fn, prompt)
    attn = next(m for m in model.modules() if isinstance(m, Attention))
    assert (attn.k_scale, attn.v_scale) == pytest.approx((0.05, 0.02))
    # Scales change what the cache holds (K / 0.05 uses more of e4m3's range), not what attention means.
    assert (fp8 - exact).abs().max() < 0.1 and (scaled - exact).abs().max() < 0.1
    assert not torch.equal(scaled, fp8)


def test_smollm2_perplexity_fp8_vs_fp32_cache():
    """Perplexity of the embedded SmolLM2 (GGUF, fp32 compute) on TEXT through the paged model, 64-token
    chunks (every chunk after the first reads the earlier tokens back from the cache)."""
    from pagedllm.loader import get_tokenizer

    config = EngineArgs(model=None).create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    ids = get_tokenizer(config.model_config.source).encode(TEXT)
    ppl = {}
    for cache_dtype in (torch.float32, torch.float8_e4m3fn):
        runner = PagedRunner(model, num_blocks=64, block_size=16)
        for m in model.modules():
            if isinstance(m, Attention):
                m.bind_kv_cache(torch.zeros(2, 64, 16, m.num_kv_heads, m.head_dim).to(cache_dtype),
                                TorchAttentionBackend())
        logits = torch.cat([runner.step({"t": ids[i:i + 64]})["t"] for i in range(0, len(ids), 64)])
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:]))
        ppl[cache_dtype] = math.exp(nll.item())
    delta = ppl[torch.float8_e4m3fn] / ppl[torch.float32] - 1
    print(f"\nSmolLM2-135M perplexity on {len(ids)} tokens: fp32 KV {ppl[torch.float32]:.3f}, "
          f"fp8 KV {ppl[torch.float8_e4m3fn]:.3f} ({100 * delta:+.2f}%)")
    assert abs(delta) < 0.05


def test_engine_runs_an_fp8_cache_with_swap_preemption():
    """Through `LLM`: greedy tokens with an fp8 cache follow the fp32-cache ones, also when requests
    are swapped out to host memory and back (the blocks move as bytes)."""
    from pagedllm import LLM, SamplingParams

    path, _ = qc.fidelity_model()
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(1, 512, (10,), generator=gen).tolist()} for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for cache in ("float32", "fp8"):
        # 16 blocks of 4 tokens cannot hold 4 requests of 26 tokens: preemption (swap) must happen.
        llm = LLM(path, skip_tokenizer_init=True, kv_cache_dtype=cache, block_size=4, num_gpu_blocks_override=16,
                  preemption_mode="swap", max_model_len=64, swap_space=0.01)
        tokens[cache] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        swapped = llm.llm_engine.engine_core.model_executor.driver_worker.swap_space
        assert swapped is not None and swapped.cpu_caches[0].dtype == (torch.uint8 if cache == "fp8" else torch.float32)
        del llm
    equal = sum(a == b for x, y in zip(tokens["float32"], tokens["fp8"]) for a, b in zip(x, y))
    assert equal / (4 * 16) >= 0.9, (tokens["float32"], tokens["fp8"])
