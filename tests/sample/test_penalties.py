import pytest
import torch

from pagedllm.sample import Sampler
from pagedllm.sample.penalties import apply_penalties, get_token_bin_counts_and_mask
from pagedllm.sampling_params import SamplingParams as SP

V = 6


def test_bin_counts_ignore_padding():
    counts, mask = get_token_bin_counts_and_mask(torch.tensor([[2, 2, 0, V], [V, V, V, V]]), V, 2)
    assert counts.tolist() == [[1, 0, 2, 0, 0, 0], [0] * V]
    assert mask.tolist() == [[True, False, True, False, False, False], [False] * V]


def test_penalties_by_hand():
    logits = torch.tensor([[3.0, -1.0, 2.0, 0.5, -2.0, 1.0]])
    prompt = torch.tensor([[0, 1, V]])  # tokens 0 and 1 in the prompt
    output = torch.tensor([[2, 2, 3]])  # token 2 twice, token 3 once
    out = apply_penalties(
        logits.clone(),
        prompt,
        output,
        presence_penalties=torch.tensor([0.5]),
        frequency_penalties=torch.tensor([0.25]),
        repetition_penalties=torch.tensor([2.0]),
    )
    expected = [
        3.0 / 2,  # prompt, positive: divided
        -1.0 * 2,  # prompt, negative: multiplied
        2.0 / 2 - 0.25 * 2 - 0.5,  # output twice: repetition, frequency x2, presence
        0.5 / 2 - 0.25 * 1 - 0.5,  # output once
        -2.0,  # unseen: untouched
        1.0,
    ]
    assert out[0].tolist() == pytest.approx(expected)


def test_each_penalty_alone_through_sampler(make_md):
    # One row per penalty kind; greedy, so the argmax shows the effect.
    logits = torch.tensor([[5.0, 4.9, 0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    params = [
        SP(temperature=0, repetition_penalty=1.1),  # 5.0/1.1 = 4.55 < 4.9
        SP(temperature=0, frequency_penalty=0.05),  # 5.0 - 3*0.05 = 4.85 < 4.9
        SP(temperature=0, presence_penalty=0.2),  # 5.0 - 0.2 = 4.8 < 4.9
        SP(temperature=0),  # no penalty: token 0 stays
    ]
    md = make_md(params, V, prompts=[[0], [5], [5], [0]], outputs=[[], [0, 0, 0], [0], [0, 0]])
    assert Sampler()(logits.clone(), md).sampled_token_ids.tolist() == [1, 1, 1, 0]


def test_repetition_penalty_sees_output_tokens(make_md):
    md = make_md([SP(temperature=0, repetition_penalty=2.0)], V, prompts=[[5]], outputs=[[0]])
    logits = torch.tensor([[4.0, 3.0, -1.0, -1.0, -1.0, -1.0]])
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]


def test_min_tokens_masks_stop_ids(make_md):
    logits = torch.tensor([[0.0, 1.0, 9.0, 8.0, 0.0, 0.0]]).repeat(2, 1)
    p = SP(temperature=0, min_tokens=2, stop_token_ids=[2, 3])
    md = make_md([p, p], V, outputs=[[4], [4, 4]])
    # row 0 owes one more token: 2 and 3 are masked, so 1 wins; row 1 is free to stop.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1, 2]


def test_min_tokens_masks_for_sampled_rows(make_md):
    logits = torch.tensor([[0.0, 0.0, 9.0, 0.0, 0.0, 0.0]]).repeat(500, 1)
    md = make_md([SP(temperature=1.0, min_tokens=1, stop_token_ids=[2])] * 500, V)
    assert 2 not in Sampler()(logits, md).sampled_token_ids.tolist()


def test_logit_bias_forces_a_token(make_md):
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).repeat(3, 1)
    params = [
        SP(temperature=0, logit_bias={4: 100}),
        SP(temperature=1.0, logit_bias={3: 100}),
        SP(temperature=0),
    ]
    assert Sampler()(logits, make_md(params, V)).sampled_token_ids.tolist() == [4, 3, 0]


def test_logit_bias_can_ban_a_token(make_md):
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0, 0.0, 0.0]])
    md = make_md([SP(temperature=0, logit_bias={0: -100})], V)
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [1]
