"""SamplingParams.prompt_logprobs (vLLM's; what lm-eval's loglikelihood tasks read): every prompt token
but the first scored by the model's log-softmax at the position before it, held to transformers."""

from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from pagedllm import LLM

    # a small token budget: a 70-token prompt runs in several chunks
    return LLM(str(tiny_model_dir), num_gpu_blocks_override=64, max_model_len=256, max_num_batched_tokens=32,
               max_num_seqs=4, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)

    return run


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, 5000, (n,), generator=g).tolist() for n in (1, 2, 9, 70)]


def test_prompt_logprobs_match_transformers(llm, hf_logprobs):
    from pagedllm import SamplingParams
    from tests.utils import assert_pool_idle

    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompt) and plp[0] is None
        ref = hf_logprobs(prompt)
        for t in range(1, len(prompt)):
            entry = plp[t]
            tok = prompt[t]
            assert tok in entry and 4 >= len(entry) >= 3  # the prompt token, and the top 3 (it may be one)
            assert math.isclose(entry[tok].logprob, ref[t - 1, tok].item(), abs_tol=2e-3)
            # the rank counts strictly higher logprobs: in a 49,152-token tail near-ties move it a little
            want_rank = int((ref[t - 1] > ref[t - 1, tok]).sum()) + 1
            assert abs(entry[tok].rank - want_rank) <= max(0, want_rank // 1000), (entry[tok].rank, want_rank)
            top = sorted((lp.logprob for tid, lp in entry.items() if lp.rank <= 3), reverse=True)[:3]
            assert torch.allclose(torch.tensor(top), ref[t - 1].topk(3).values, atol=2e-3)
            assert entry[tok].decoded_token is not None
    assert_pool_idle(llm)


def test_prompt_logprobs_ignore_the_prefix_cache_and_zero_k(llm, hf_logprobs):
    # the same prompt twice: the second would hit the prefix cache, which would leave its positions unscored
    from pagedllm import SamplingParams

    prompt = _prompts()[3]
    for _ in range(2):
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(prompt)
        assert all(len(e) == 1 for e in out.prompt_logprobs[1:])
    ref = hf_logprobs(prompt)
    got = [out.prompt_logprobs[t][prompt[t]].logprob for t in range(1, len(prompt))]
    want = [ref[t - 1, prompt[t]].item() for t in range(1, len(prompt))]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3


def test_lm_eval_style_loglikelihood(llm, hf_logprobs):
    # lm-eval's vLLM backend: prompt_logprobs=1, max_tokens=1, detokenize=False; the continuation's logprob
    # is the sum over its tokens' entries
    from pagedllm import SamplingParams

    ctx, cont = _prompts()[2], [11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, detokenize=False)
    out = llm.generate([{"prompt_token_ids": ctx + cont}], params, use_tqdm=False)[0]
    ll = sum(out.prompt_logprobs[len(ctx) + i][t].logprob for i, t in enumerate(cont))
    ref = hf_logprobs(ctx + cont)
    want = sum(ref[len(ctx) + i - 1, t].item() for i, t in enumerate(cont))
    assert abs(ll - want) < 5e-3


def test_long_chunks_are_scored_in_slices(monkeypatch):
    # a job longer than a slice gives the same entries as one pass (worker/prompt_logprobs.compute)
    import numpy as np

    from pagedllm.worker import prompt_logprobs as pl

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 8, generator=g)
    head = torch.randn(8, 30, generator=g)
    job = pl.PromptLogprobsJob(["a", "b"], [1, 4], [20, 13], [3, 1], np.r_[np.arange(0, 20), np.arange(25, 38)],
                               torch.randint(0, 30, (33,), generator=g).numpy())
    whole = pl.compute(job, hidden, lambda h: h @ head, 30)
    monkeypatch.setattr(pl, "SLICE", 7)
    sliced = pl.compute(job, hidden, lambda h: h @ head, 30)
    assert torch.equal(whole[0], sliced[0]) and torch.equal(whole[2], sliced[2])
    assert torch.allclose(whole[1], sliced[1], atol=1e-6)  # matmuls of other row counts round alike, nearly
    lists = pl.to_lists(job, *sliced)
    assert lists["a"][0] == 1 and len(lists["a"][1]) == 20 and len(lists["a"][1][0][0]) == 4
    assert lists["b"][0] == 4 and len(lists["b"][1]) == 13 and len(lists["b"][1][0][0]) == 2


def test_prompt_logprobs_survive_preemption(tiny_model_dir, hf_logprobs):
    # 14 blocks of 16 hold two of the four 110-token requests: the others are preempted and recomputed,
    # and a recomputed prompt's positions are not added twice
    from pagedllm import LLM, SamplingParams
    from tests.utils import assert_pool_idle

    llm = LLM(str(tiny_model_dir), num_gpu_blocks_override=14, max_model_len=128, max_num_batched_tokens=32,
              max_num_seqs=4)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 5000, (70,), generator=g).tolist() for _ in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    for prompt, out in zip(prompts, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
                           strict=True):
        assert len(out.prompt_logprobs) == len(prompt) and len(out.outputs[0].token_ids) == 40
        ref = hf_logprobs(prompt)
        err = max(abs(out.prompt_logprobs[t][prompt[t]].logprob - ref[t - 1, prompt[t]].item())
                  for t in range(1, len(prompt)))
        assert err < 2e-3
    assert_pool_idle(llm)
