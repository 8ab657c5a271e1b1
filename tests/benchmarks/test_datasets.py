"""The benchmark workloads: W1 drawn exactly as the peers draw it, the random dataset's flags."""

from __future__ import annotations

import argparse
import random

import pytest

from pagedllm.benchmarks.datasets import (
    add_dataset_args,
    check_fits,
    len_range,
    random_requests,
    requests_from_args,
    w1_requests,
)


def peers_w1(n: int = 256, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The draw of /work/shared/peers/peer_vllm.py and peer_hf_cb.py, written out again."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    return prompts, outs


def test_w1_is_the_peers_draw() -> None:
    prompts, outs = peers_w1()
    reqs = w1_requests()
    assert len(reqs) == 256
    assert [r.prompt_token_ids for r in reqs] == prompts
    assert [r.expected_output_len for r in reqs] == outs
    # The first lengths, so that a change of the draw shows at a glance.
    assert [r.prompt_len for r in reqs[:4]] == [len(p) for p in prompts[:4]]
    assert sum(outs) == 133966  # the peers' roofline prints "output tokens 133966"


def test_w1_with_fewer_prompts_matches_the_peers_with_n() -> None:
    prompts, outs = peers_w1(8)
    reqs = w1_requests(8)
    assert [r.prompt_token_ids for r in reqs] == prompts and [r.expected_output_len for r in reqs] == outs


def test_random_requests_ranges_ids_and_seed() -> None:
    reqs = random_requests(50, (3, 9), (2, 4), token_max=7, seed=3)
    assert all(3 <= r.prompt_len <= 9 and 2 <= r.expected_output_len <= 4 for r in reqs)
    assert {t for r in reqs for t in r.prompt_token_ids} == set(range(7))
    assert reqs == random_requests(50, (3, 9), (2, 4), token_max=7, seed=3)
    assert reqs != random_requests(50, (3, 9), (2, 4), token_max=7, seed=4)
    fixed = random_requests(4, (5, 5), (6, 6), token_max=10)
    assert [(r.prompt_len, r.expected_output_len) for r in fixed] == [(5, 6)] * 4
    with pytest.raises(ValueError, match="input length range"):
        random_requests(1, (5, 4), (1, 1))


def test_len_range() -> None:
    assert len_range(1000, 0.1) == (900, 1100)
    assert len_range(7, 0.0) == (7, 7)
    with pytest.raises(ValueError, match="range-ratio"):
        len_range(10, 1.5)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_dataset_args(p)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def test_flags() -> None:
    # vLLM's names and ours for the same thing.
    a = requests_from_args(parse("--dataset-name", "random", "--random-input-len", "12", "--output-len", "3",
                                 "--num-prompts", "5"))
    b = requests_from_args(parse("--dataset", "random", "--input-len", "12", "--random-output-len", "3",
                                 "--num-prompts", "5"))
    assert a == b and [(r.prompt_len, r.expected_output_len) for r in a] == [(12, 3)] * 5
    r = requests_from_args(parse("--random-input-len-range", "4", "6", "--random-output-len-range", "1", "2",
                                 "--num-prompts", "30", "--random-token-max", "5"))
    assert {x.prompt_len for x in r} == {4, 5, 6} and {x.expected_output_len for x in r} == {1, 2}
    assert max(t for x in r for t in x.prompt_token_ids) < 5
    assert len(requests_from_args(parse())) == 1000  # vLLM's default --num-prompts
    assert requests_from_args(parse("--dataset", "w1")) == w1_requests()
    with pytest.raises(ValueError, match="w1 fixes its lengths"):
        requests_from_args(parse("--dataset", "w1", "--input-len", "5"))


def test_check_fits() -> None:
    reqs = random_requests(3, (4, 4), (4, 4), token_max=100)
    check_fits(reqs, vocab_size=100, max_model_len=8)
    with pytest.raises(ValueError, match="random-token-max"):
        check_fits(reqs, vocab_size=50, max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        check_fits(reqs, vocab_size=100, max_model_len=7)
