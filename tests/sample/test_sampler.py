import math

import pytest
import torch

import pagedllm.sample.sampler as sampler_mod
from pagedllm.sample import Sampler, new_generator
from pagedllm.sample.topk_topp import random_sample
from pagedllm.sampling_params import SamplingParams as SP

V = 50


def sample(make_md, logits, params, **kw):
    return Sampler()(logits.clone(), make_md(params, logits.shape[1], **kw))


def test_greedy_is_argmax(make_md):
    logits = torch.randn(8, V)
    out = sample(make_md, logits, [SP(temperature=0.0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


def test_greedy_rows_in_mixed_batch(make_md):
    logits = torch.randn(6, V)
    params = [
        SP(temperature=0.0),
        SP(temperature=1.5),
        SP(temperature=0.0, seed=4),
        SP(temperature=0.9, top_k=5),
        SP(temperature=1e-6),
        SP(temperature=1.0, top_p=0.5),
    ]
    out = sample(make_md, logits, params).sampled_token_ids
    for r in (0, 2, 4):
        assert out[r].item() == logits[r].argmax().item()


def test_all_greedy_batch_does_no_softmax_or_sort(make_md, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("an all-greedy batch must not reach truncation or sampling")

    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p", boom)
    monkeypatch.setattr(sampler_mod, "random_sample", boom)
    monkeypatch.setattr(sampler_mod, "apply_min_p", boom)
    logits = torch.randn(4, V)
    out = sample(make_md, logits, [SP(temperature=0.0, top_p=0.3, top_k=3, min_p=0.2)] * 4)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_logprobs_are_raw_log_softmax_with_ranks(make_md):
    logits = torch.randn(4, V)
    params = [
        SP(temperature=1.0, logprobs=3),
        SP(temperature=0.0, logprobs=1, logit_bias={7: 50.0}),  # bias changes the pick, not the logprobs
        SP(temperature=0.7, top_k=10, repetition_penalty=1.3),  # asked none: still gets k columns
        SP(temperature=0.0, logprobs=0, presence_penalty=2.0),
    ]
    out = sample(make_md, logits, params, outputs=[[], [], [1, 2], [int(logits[3].argmax())]])
    lp = out.logprobs
    ref = torch.log_softmax(logits, dim=-1)
    ids = out.sampled_token_ids
    assert lp.logprob_token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert torch.equal(lp.logprob_token_ids[:, 0], ids)
    assert torch.allclose(lp.logprobs, ref.gather(1, lp.logprob_token_ids))
    top_vals, top_ids = ref.topk(3, dim=-1)
    assert torch.equal(lp.logprob_token_ids[:, 1:], top_ids)
    assert torch.allclose(lp.logprobs[:, 1:], top_vals)
    expected_ranks = [1 + int((ref[r] > ref[r, ids[r]]).sum()) for r in range(4)]
    assert lp.selected_token_ranks.tolist() == expected_ranks
    assert ids[1].item() == 7 and expected_ranks[1] > 1  # forced by the bias, rank from the raw logits
    assert expected_ranks[3] > 1  # the presence penalty moved greedy off the raw argmax


def test_logprobs_zero_gives_only_the_sampled_column(make_md):
    logits = torch.randn(2, V)
    lp = sample(make_md, logits, [SP(temperature=0.0, logprobs=0)] * 2).logprobs
    assert lp.logprob_token_ids.shape == (2, 1)
    assert lp.selected_token_ranks.tolist() == [1, 1]
    ids, values, ranks = lp.tolists()
    assert ids == logits.argmax(dim=-1).unsqueeze(1).tolist() and ranks == [1, 1]
    assert values[0][0] == pytest.approx(torch.log_softmax(logits[0], -1).max().item(), abs=1e-6)


def test_top_k_1_equals_greedy(make_md):
    logits = torch.randn(16, V)
    params = [SP(temperature=1.5, top_k=1, seed=i if i % 2 else None) for i in range(16)]
    assert torch.equal(sample(make_md, logits, params).sampled_token_ids, logits.argmax(dim=-1))


def test_tiny_top_p_keeps_only_the_max(make_md):
    logits = torch.randn(16, V) * 0.1  # flat distributions: without top_p almost anything goes
    params = [SP(temperature=2.0, top_p=1e-4)] * 16
    assert torch.equal(sample(make_md, logits, params).sampled_token_ids, logits.argmax(dim=-1))


def test_min_p_limits_the_support(make_md):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04])
    logits = probs.log().repeat(2000, 1)
    # threshold 0.25 * 0.4 = 0.1 keeps tokens 0, 1, 2 only.
    picked = sample(make_md, logits, [SP(temperature=1.0, min_p=0.25)] * 2000).sampled_token_ids
    assert set(picked.tolist()) == {0, 1, 2}


def _frequencies(picked: torch.Tensor, n: int) -> torch.Tensor:
    return torch.bincount(picked, minlength=n).double() / picked.numel()


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_unseeded_distribution(make_md, temperature):
    n = 2000
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(n, 1)
    picked = sample(make_md, logits, [SP(temperature=temperature)] * n).sampled_token_ids
    target = probs ** (1 / temperature)
    target = (target / target.sum()).double()
    # 4.5 standard deviations of a binomial frequency: fails only if the sampler is biased.
    tol = 4.5 * torch.sqrt(target * (1 - target) / n)
    assert torch.all((_frequencies(picked, 3) - target).abs() < tol), _frequencies(picked, 3)


def test_draw_never_picks_a_zero_probability_token():
    # The CPU's inverse-CDF draw: tokens of probability 0 have empty intervals, including the
    # first and the last; frequencies follow the rest.
    n = 4000
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.0, 0.2, 0.0]).repeat(n, 1)
    picked = random_sample(probs.clone(), {})
    target = probs[0].double()
    tol = 4.5 * torch.sqrt(target * (1 - target) / n)
    assert torch.all((_frequencies(picked, 7) - target).abs() <= tol), _frequencies(picked, 7)


def test_top_k_distribution_renormalises(make_md):
    n = 3000
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(n, 1)
    picked = sample(make_md, logits, [SP(temperature=1.0, top_k=2)] * n).sampled_token_ids
    target = torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.double)
    assert torch.all((_frequencies(picked, 4) - target).abs() < 0.04)


def test_top_k_top_p_distribution(make_md):
    n = 3000
    probs = torch.tensor([0.45, 0.25, 0.2, 0.1])
    logits = probs.log().repeat(n, 1)
    # top_k 3 -> [0.5, 0.278, 0.222]; top_p 0.7 keeps the first two -> [0.643, 0.357].
    picked = sample(make_md, logits, [SP(temperature=1.0, top_k=3, top_p=0.7)] * n).sampled_token_ids
    target = torch.tensor([0.45 / 0.7, 0.25 / 0.7, 0.0, 0.0], dtype=torch.double)
    assert torch.all((_frequencies(picked, 4) - target).abs() < 0.04)


def _seeded_run(make_md, row_logits, seed, others, position, steps=6):
    """Sample `steps` tokens for a seeded request placed at `position` among `others` rows."""
    gen = new_generator(seed, "cpu")
    tokens = []
    for step in range(steps):
        params = list(others)
        params.insert(position, SP(temperature=1.0, top_p=0.95, seed=seed))
        gens = [None if p.seed is None else new_generator(p.seed + 1000 * step, "cpu") for p in params]
        gens[position] = gen  # the request's own generator lives across steps
        logits = torch.randn(len(params), V) * 3
        logits[position] = row_logits[step]
        out = Sampler()(logits, make_md(params, V, generators=gens))
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


def test_seeded_row_is_batch_independent(make_md):
    row_logits = torch.randn(6, V)  # flat enough that the seed decides the token
    a = _seeded_run(make_md, row_logits, 42, [SP(temperature=0.0), SP(temperature=0.8)], position=0)
    others = [
        SP(temperature=1.0, top_k=3),
        SP(temperature=0.5, seed=7),
        SP(temperature=0.0),
        SP(temperature=1.2, top_p=0.9),
        SP(temperature=0.9, min_p=0.1),
    ]
    torch.manual_seed(123)  # the unseeded rows' draws change too
    b = _seeded_run(make_md, row_logits, 42, others, position=3)
    assert a == b
    c = _seeded_run(make_md, row_logits, 43, others, position=3)
    assert c != a  # a different seed gives a different stream (6 draws from ~50 tokens)


def test_seeded_row_alone_matches_batch(make_md):
    # Every row seeded: the batched draw is skipped, each row still uses only its own generator.
    logits = torch.randn(3, V)
    params = [SP(temperature=1.0, seed=s) for s in (1, 2, 3)]
    together = Sampler()(logits.clone(), make_md(params, V)).sampled_token_ids.tolist()
    alone = [
        Sampler()(logits[i : i + 1].clone(), make_md([params[i]], V)).sampled_token_ids.item()
        for i in range(3)
    ]
    assert together == alone


def test_shape_mismatch_raises(make_md):
    md = make_md([SP()] * 2, V)
    with pytest.raises(ValueError, match="num_reqs=2"):
        Sampler()(torch.randn(3, V), md)
    with pytest.raises(ValueError, match="vocab_size=50"):
        Sampler()(torch.randn(2, V + 1), md)


def test_empty_batch(make_md):
    out = Sampler()(torch.empty(0, V), make_md([], V))
    assert out.sampled_token_ids.shape == (0,)


def test_low_precision_logits_are_sampled_in_float32(make_md):
    logits = torch.randn(4, V).to(torch.bfloat16)
    out = sample(make_md, logits, [SP(temperature=0.0, logprobs=2)] * 4)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(dim=-1))
    assert out.logprobs.logprobs.dtype == torch.float32
    assert not math.isnan(out.logprobs.logprobs.sum().item())


def test_bf16_logits_sample_as_their_float32_copy(make_md):
    # The sampler takes the LM head's bf16 logits and casts only where float32 matters; every
    # output must equal what the float32 copy gives (bf16 -> fp32 is exact).
    logits = (torch.randn(6, V) * 3).to(torch.bfloat16)
    # Row 1: 1.9921875 + bias 0.006 stays below 2.0 in float32; in bf16 it would round up to a tie.
    logits[1, :2] = torch.tensor([1.9921875, 2.0])
    logits[1, 2:] = 0.0
    params = [
        SP(temperature=0.0, logprobs=3),
        SP(temperature=0.0, logit_bias={0: 0.006}, logprobs=1),
        SP(temperature=0.0, repetition_penalty=1.1),
        SP(temperature=0.8, seed=3, logprobs=2),
        SP(temperature=1.0, top_k=5, seed=4),
        SP(temperature=0.7, top_p=0.9, min_p=0.05, seed=5, logprobs=0),
    ]
    outs = [[1, 2], [], [3], [], [4], []]
    a = Sampler()(logits.clone(), make_md(params, V, outputs=outs))
    b = Sampler()(logits.float(), make_md(params, V, outputs=outs))
    assert a.sampled_token_ids.tolist() == b.sampled_token_ids.tolist()
    assert a.sampled_token_ids[1].item() == 1
    assert a.logprobs.logprobs.dtype == torch.float32
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(a.logprobs.logprobs[:, 0], logits.float().log_softmax(-1).gather(1, a.logprobs.logprob_token_ids[:, :1])[:, 0])


def test_all_greedy_bf16_needs_no_float32_copy(make_md, monkeypatch):
    logits = torch.randn(4, V).to(torch.bfloat16)

    def no_copy(*args, **kwargs):
        raise AssertionError("an all-greedy batch without logprobs or edits must read the logits as they are")

    md = make_md([SP(temperature=0.0)] * 4, V)
    monkeypatch.setattr(torch.Tensor, "float", no_copy)
    monkeypatch.setattr(torch.Tensor, "to", no_copy)
    ids = Sampler()(logits, md).sampled_token_ids
    monkeypatch.undo()
    assert torch.equal(ids, logits.float().argmax(dim=-1))
