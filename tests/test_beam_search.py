"""LLM.beam_search (pagedllm/beam_search.py), vLLM's offline beam search: it was missing (AttributeError).
Checked against the same search run on transformers' logits of the same tiny model."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.beam_search import BeamSearchOutput, get_beam_search_score
from pagedllm.sampling_params import BeamSearchParams
from tests.utils import assert_pool_idle, tiny_model

PROMPT = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def model():
    path, hf = tiny_model("llama3", vocab_size=49152, with_tokenizer=True)
    return LLM(path, num_gpu_blocks_override=256, max_model_len=128), hf


def reference(hf, prompt: list[int], width: int, steps: int) -> list[tuple[list[int], float]]:
    """vLLM's algorithm (top 2 * width candidates a beam, keep the width best by the length-normalized
    score) on transformers' fp32 logprobs; no EOS, so every beam runs `steps` tokens."""
    beams = [(list(prompt), 0.0)]
    for _ in range(steps):
        cands = []
        for tokens, cum in beams:
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(lp, 2 * width)
            cands += [(tokens + [t], cum + v) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        beams = sorted(cands, key=lambda b: get_beam_search_score(b[0], b[1], None), reverse=True)[:width]
    return beams


def test_beam_search_matches_the_reference_search(model):
    llm, hf = model
    outs = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=3, max_tokens=4,
                                                                           ignore_eos=True))
    assert len(outs) == 1 and isinstance(outs[0], BeamSearchOutput)
    got = outs[0].sequences
    want = reference(hf, PROMPT, 3, 4)
    assert [s.tokens for s in got] == [b[0] for b in want]
    for s, (_, cum) in zip(got, want):
        assert s.cum_logprob == pytest.approx(cum, abs=1e-3)
        assert len(s.logprobs) == 4 and s.finish_reason == "length"
        assert s.text == llm.get_tokenizer().decode(s.tokens)  # vLLM's: the prompt and the completion
    assert_pool_idle(llm)


def test_width_one_is_greedy_and_prompts_keep_their_order(model):
    llm, _ = model
    greedy = llm.generate([{"prompt_token_ids": PROMPT}, "The quick brown fox"],
                          SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    outs = llm.beam_search([{"prompt_token_ids": PROMPT}, {"prompt": "The quick brown fox"}],
                           BeamSearchParams(beam_width=1, max_tokens=5, ignore_eos=True), concurrency_limit=1)
    for g, o in zip(greedy, outs):
        assert o.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids


@pytest.mark.parametrize("kwargs, words", [
    ({"beam_width": 0, "max_tokens": 4}, ["beam_width", ">= 1"]),
    ({"beam_width": 2, "max_tokens": True}, ["max_tokens"]),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, ["length_penalty"]),
])
def test_bad_params_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as e:
        BeamSearchParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_what_cannot_run_is_refused_before_the_search(model):
    llm, _ = model
    with pytest.raises(ValueError, match="beam_width=11 needs 22 logprobs"):
        llm.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=2, max_tokens=125))
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([{"prompt": "hi"}], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=object())
    assert_pool_idle(llm)
