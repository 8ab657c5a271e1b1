"""Sliding-window attention in the paged cache: Mistral and Qwen2 with a window shorter than prompt +
generation give transformers' greedy tokens (chunked prefill and prefix caching on), and a Mistral
context 17 windows long runs in a pool of 5 windows (blocks behind the window are freed)."""

from __future__ import annotations

import random

import pytest
from greedy_check import TINY, check_greedy_matches_transformers, save_tiny
from transformers import MistralConfig, Qwen2Config

from pagedllm import LLM, SamplingParams
from pagedllm.models.utils import sliding_window_for_layer
from tests.utils import assert_pool_idle, hf_greedy, track_peak_blocks


def test_mistral_window_shorter_than_the_context_matches_transformers():
    # Window 8: prompts of 5..42 tokens plus 32 new ones all run past it.
    config = MistralConfig(**TINY, sliding_window=8, architectures=["MistralForCausalLM"])
    check_greedy_matches_transformers(config, seed=4)


def test_qwen2_window_on_upper_layers_only_matches_transformers():
    # use_sliding_window with max_window_layers 1: layer 0 full attention, layer 1 a 6-token window.
    config = Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1,
                         architectures=["Qwen2ForCausalLM"])
    assert [sliding_window_for_layer(config, i) for i in range(2)] == [None, 6]
    check_greedy_matches_transformers(config, seed=5)


@pytest.fixture(scope="module")
def long_mistral(tmp_path_factory):
    # Window 64 over a 1,000-token prompt + 96 new tokens: the context is 17 windows long.
    config = MistralConfig(**{**TINY, "max_position_embeddings": 2048}, sliding_window=64,
                           architectures=["MistralForCausalLM"])
    path = str(tmp_path_factory.mktemp("long-mistral"))
    hf = save_tiny(config, path, seed=6)
    rng = random.Random(6)
    prompt = [rng.randrange(1, 256) for _ in range(1000)]
    return path, hf, prompt, hf_greedy(hf, prompt, 96), {}  # {}: turn 2's reference, computed once


@pytest.mark.parametrize("chunk", [40, 160])  # prefill chunks shorter and longer than the window
def test_context_many_windows_long_matches_transformers_in_a_bounded_pool(long_mistral, chunk):
    path, hf, prompt, ref, ref2 = long_mistral
    # 20 blocks of 16 hold 320 tokens: the 1,100-token requests fit only because blocks behind the
    # window are freed (without it the request is refused at add_request).
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=16, num_gpu_blocks_override=20,
              enable_prefix_caching=True, max_num_batched_tokens=chunk, max_num_seqs=4)
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    assert kv.sliding_window == 64
    peak = track_peak_blocks(kv)
    params = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == ref
    # A follow-up turn: the whole first conversation is a prefix hit through its last window only.
    follow = prompt + list(out) + list(range(1, 31))
    hits_before = kv.prefix_cache_hits
    short = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out2 = llm.generate([{"prompt_token_ids": follow}], short, use_tqdm=False)[0].outputs[0].token_ids
    assert kv.prefix_cache_hits - hits_before >= 1000
    if "turn 2" not in ref2:
        ref2["turn 2"] = hf_greedy(hf, follow, 8)
    assert out2 == ref2["turn 2"]
    # One step holds (W - 1 + chunk) / 16 + 1 blocks at most, far below the 71 of the whole context.
    assert peak[0] <= -(-(63 + chunk) // 16) + 1, peak[0]
    assert_pool_idle(llm)
