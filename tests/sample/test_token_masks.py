"""allowed_token_ids and bad_words (sample/token_masks.py): the masks alone, then end to end offline
(SamplingParams) on a tiny model, where the unconstrained output is shown to differ first."""

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.sample.token_masks import apply_allowed_token_ids, apply_bad_words, bad_word_bans
from tests.utils import tiny_model


def test_allowed_ids_keep_only_those_columns():
    logits = torch.arange(12.0).reshape(2, 6)
    out = apply_allowed_token_ids(logits.clone(), {1: [0, 2]})
    assert torch.equal(out[0], torch.arange(6.0))
    assert out[1].tolist() == [6.0, float("-inf"), 8.0] + [float("-inf")] * 3


def test_bad_words_ban_single_tokens_always_and_the_last_token_after_a_prefix():
    assert bad_word_bans([[7], [3, 4]], [1, 2]) == [7]
    assert bad_word_bans([[7], [3, 4]], [1, 3]) == [7, 4]
    assert bad_word_bans([[5, 6, 8]], [5, 6]) == [8] and bad_word_bans([[5, 6, 8]], [6, 6]) == []
    logits = torch.zeros(1, 10)
    assert apply_bad_words(logits, {0: [[3, 4]]}, [[9, 3]])[0, 4] == float("-inf")


def test_offline_requests_honour_the_constraints():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=128)
    prompt = {"prompt_token_ids": [1, 2, 3, 4]}
    free = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    free_ids = free[0].outputs[0].token_ids
    allowed = [7, 11]
    assert not set(free_ids) <= set(allowed)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                              allowed_token_ids=allowed), use_tqdm=False)
    assert set(out[0].outputs[0].token_ids) <= set(allowed)
    # truncate_prompt_tokens keeps the last k tokens: the same output as that shorter prompt.
    cut = llm.generate({"prompt_token_ids": [9, 9, 9, 1, 2, 3, 4]},
                       SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, truncate_prompt_tokens=4),
                       use_tqdm=False)
    assert cut[0].prompt_token_ids == [1, 2, 3, 4] and cut[0].outputs[0].token_ids == free_ids
