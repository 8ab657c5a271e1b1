"""Sliding-window attention in the paged cache: Mistral and Qwen2 with a window shorter than prompt +
generation give transformers' greedy tokens (chunked prefill and prefix caching on)."""

from __future__ import annotations

from greedy_check import TINY, check_greedy_matches_transformers
from transformers import MistralConfig, Qwen2Config

from pagedllm.models.utils import sliding_window_for_layer


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
