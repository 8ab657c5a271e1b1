"""Greedy tokens and logprobs equal transformers' (fp32, CPU) on tiny random models of each architecture."""

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.utils import ARCHS, assert_pool_idle, hf_greedy, tiny_model

NEW_TOKENS = 64


def prompts(vocab: int, n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(arch):
    path, hf = tiny_model(arch)
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=128)
    ps = prompts(hf.config.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, NEW_TOKENS)
        assert o.outputs[0].finish_reason == "length"
    assert_pool_idle(llm)


def test_logprobs_match_log_softmax():
    path, hf = tiny_model("qwen3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64)
    prompt = prompts(hf.config.vocab_size, n=1, seed=3)[0]
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    seq = prompt + out.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].float(), dim=-1)
    for i, (tok, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert len(lps) == 5 or (tok in lps and len(lps) == 6)
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        assert lps[tok].rank == 1  # greedy picks the top token
        top = torch.topk(row, 5)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(lps[t].logprob - v) < 1e-4
    assert abs(out.cumulative_logprob - sum(out.logprobs[i][t].logprob for i, t in enumerate(out.token_ids))) < 1e-4
