"""The worker's KV cache tensors: their memory order (PAGEDLLM_KV_CACHE_LAYOUT) and what a user sees of it, the
same tokens either way."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker.kv_cache import kv_cache_layout
from tests.utils import assert_pool_idle, tiny_model


def test_layout_defaults_and_refusal(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_KV_CACHE_LAYOUT", raising=False)
    assert kv_cache_layout(torch.device("cuda")) == "HND"
    assert kv_cache_layout(torch.device("cpu")) == "NHD"
    monkeypatch.setenv("PAGEDLLM_KV_CACHE_LAYOUT", "hnd")
    assert kv_cache_layout(torch.device("cpu")) == "HND"
    monkeypatch.setenv("PAGEDLLM_KV_CACHE_LAYOUT", "HDN")
    with pytest.raises(ValueError, match="PAGEDLLM_KV_CACHE_LAYOUT must be auto, NHD or HND, got 'HDN'"):
        kv_cache_layout(torch.device("cpu"))


def test_head_major_cache_gives_the_same_tokens(monkeypatch):
    path, hf = tiny_model("llama3")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % hf.config.vocab_size for j in range(5 + 9 * i)]}
               for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = {}
    for layout in ("NHD", "HND"):
        monkeypatch.setenv("PAGEDLLM_KV_CACHE_LAYOUT", layout)
        # Small blocks and chunked prefill: prompts span blocks, decodes read the cache back.
        llm = LLM(path, skip_tokenizer_init=True, max_model_len=64, block_size=4, max_num_batched_tokens=16,
                  num_gpu_blocks_override=64, device="cpu")
        cache = llm.llm_engine.engine_core.model_executor.driver_worker.kv_cache.tensors[0]
        assert cache.shape[2] == 4 and cache[0].is_contiguous() == (layout == "NHD")
        runs[layout] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_pool_idle(llm)
    assert runs["HND"] == runs["NHD"]
