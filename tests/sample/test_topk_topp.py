import math

import pytest
import torch

from pagedllm.sample.topk_topp import apply_min_p, apply_top_k_only, apply_top_k_top_p, random_sample

NEG = float("-inf")


def test_min_p_threshold():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]).log()
    out = apply_min_p(logits.clone(), torch.tensor([0.2, 0.0]))
    # row 0: threshold 0.2 * 0.5 = 0.1 drops the 0.05 token; row 1 (min_p 0) keeps everything.
    assert torch.isinf(out[0]).tolist() == [False, False, False, True]
    assert torch.equal(out[1], logits[1])


def test_top_k_only_matches_sort_path():
    logits = torch.randn(6, 50)
    k = torch.tensor([1, 3, 50, 7, 50, 49])  # 50 = vocab_size = no limit
    fast = apply_top_k_only(logits.clone(), k, max_top_k=49)
    sort_path = apply_top_k_top_p(logits.clone(), k, torch.ones(6), max_top_k=49)
    assert torch.equal(torch.isinf(fast), torch.isinf(sort_path))
    assert (~torch.isinf(fast)).sum(dim=1).tolist() == [1, 3, 50, 7, 50, 49]
    kept = torch.where(torch.isinf(fast), 0.0, fast)
    assert torch.equal(kept, torch.where(torch.isinf(fast), 0.0, logits))


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.6]), max_top_k=0)
    assert torch.isinf(out[0]).tolist() == [True, True, False, False]
    out = apply_top_k_top_p(probs.log(), None, torch.tensor([0.75]), max_top_k=0)
    assert torch.isinf(out[0]).tolist() == [True, False, False, False]


def test_top_k_and_top_p_together():
    probs = torch.tensor([[0.05, 0.15, 0.2, 0.25, 0.35]])
    # top_k 3 keeps {0.2, 0.25, 0.35}, renormalised to {0.25, 0.3125, 0.4375}; top_p 0.5 keeps the top two.
    out = apply_top_k_top_p(probs.log(), torch.tensor([3]), torch.tensor([0.5]), max_top_k=3)
    assert torch.isinf(out[0]).tolist() == [True, True, True, False, False]
    assert out[0, 3:].tolist() == pytest.approx([math.log(0.25), math.log(0.35)])


def test_random_sample_never_picks_zero_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5]]).repeat(2000, 1)
    picked = random_sample(probs, {})
    assert set(picked.tolist()) == {1, 3}


def test_bounded_top_k_top_p_matches_sort_path():
    # Every row has a top_k: top-p on the max_top_k candidates must drop the same tokens as the
    # full-vocabulary sort (random logits, so no ties at the k-th value).
    logits = torch.randn(8, 200) * 2
    k = torch.tensor([1, 5, 20, 40, 40, 3, 17, 40])
    p = torch.tensor([0.9, 0.5, 0.95, 0.3, 1.0, 0.01, 0.8, 0.99])
    bounded = apply_top_k_top_p(logits.clone(), k, p, max_top_k=40, all_rows_top_k=True)
    sort_path = apply_top_k_top_p(logits.clone(), k, p, max_top_k=40, all_rows_top_k=False)
    assert torch.equal(torch.isinf(bounded), torch.isinf(sort_path))
    kept = ~torch.isinf(bounded)
    assert torch.equal(bounded[kept], logits[kept])
    assert kept.sum(dim=1).tolist()[0] == 1 and kept[4].sum().item() == 40


def test_bounded_path_keeps_candidates_of_unlimited_rows():
    # A greedy row (k = vocab_size) keeps its max_top_k best tokens, so its argmax is untouched.
    logits = torch.randn(2, 30)
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2, 30]), torch.tensor([0.9, 1.0]), 2, True)
    assert out[1].argmax() == logits[1].argmax()
    assert (~torch.isinf(out[1])).sum().item() == 2
