import numpy as np
import pytest
import torch

from pagedllm.sample import RowInputs, SamplingMetadata, new_generator
from pagedllm.sample.metadata import make_tensor_with_pad
from pagedllm.sampling_params import SamplingParams as SP

V = 16


def test_neutral_fields_are_none(make_md):
    md = make_md([SP(temperature=0.8), SP(temperature=1.0)], V)
    assert md.all_random and not md.all_greedy
    assert md.top_p is None and md.top_k is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None
    assert md.generators == {} and md.max_num_logprobs is None
    assert md.min_tokens == {} and md.logit_bias is None
    assert md.temperature.dtype == torch.float32 and md.temperature.tolist() == pytest.approx([0.8, 1.0])


def test_all_greedy_skips_truncation_and_generators(make_md):
    # top_k / top_p / seed mean nothing for greedy rows, so they must not switch work on.
    md = make_md([SP(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1, seed=1)], V)
    assert md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.generators == {}


def test_mixed_batch_columns(make_md):
    params = [
        SP(temperature=0.0, top_k=2),  # greedy: its top_k is ignored
        SP(temperature=0.7, top_k=5, top_p=0.9, seed=3, logprobs=2),
        SP(temperature=1.0, top_k=100, min_p=0.05, logprobs=4, repetition_penalty=1.5),
    ]
    md = make_md(params, V, prompts=[[1, 2], [3], [4, 5, 6]])
    assert not md.all_greedy and not md.all_random
    assert md.top_k.tolist() == [V, 5, V]  # 100 >= V means "no limit"
    assert md.max_top_k == 5
    assert not md.all_rows_top_k  # row 2 samples with no limit
    assert md.top_p.tolist() == pytest.approx([1.0, 0.9, 1.0])
    assert md.min_p.tolist() == pytest.approx([0.0, 0.0, 0.05])
    assert md.repetition_penalties.tolist() == pytest.approx([1.0, 1.0, 1.5])
    assert md.presence_penalties is None and md.frequency_penalties is None
    assert md.prompt_token_ids.tolist() == [[1, 2, V], [3, V, V], [4, 5, 6]]
    assert list(md.generators) == [1]
    assert md.max_num_logprobs == 4


def test_all_rows_top_k_ignores_greedy_rows(make_md):
    md = make_md([SP(temperature=0.0), SP(top_k=4, top_p=0.9), SP(top_k=7)], V)
    assert md.all_rows_top_k and md.max_top_k == 7 and md.top_k.tolist() == [V, 4, 7]


def test_logprobs_capped_at_vocab_and_zero_kept(make_md):
    assert make_md([SP(logprobs=0)], V).max_num_logprobs == 0
    assert make_md([SP(logprobs=1000)], V).max_num_logprobs == V


def test_min_tokens_only_while_owed(make_md):
    p = SP(min_tokens=3, stop_token_ids=[7, 9])
    md = make_md([p, p, SP(min_tokens=3)], V, outputs=[[1], [1, 2, 3], [1]])
    # row 0 still owes 2 tokens; row 1 is done; row 2 has no stop ids to mask.
    assert md.min_tokens == {0: (2, {7, 9})}


def test_logit_bias_per_row(make_md):
    md = make_md([SP(), SP(logit_bias={3: 5.0})], V)
    assert md.logit_bias == [None, {3: 5.0}]


def test_bad_inputs_raise_value_error(make_md):
    with pytest.raises(ValueError, match="generator"):
        SamplingMetadata.build([RowInputs(SP(seed=1), [0], [], None)], V, "cpu")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_md([SP(logit_bias={V: 1.0})], V)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        make_md([SP(min_tokens=2, stop_token_ids=[V + 3])], V)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingMetadata.build([], 0, "cpu")


def test_seeded_greedy_row_needs_no_generator():
    md = SamplingMetadata.build([RowInputs(SP(temperature=0.0, seed=1), [0], [], None)], V, "cpu")
    assert md.all_greedy and md.generators == {}


def test_generator_device_checked():
    gen = new_generator(0, "cpu")
    with pytest.raises(ValueError, match="generator is on"):
        SamplingMetadata.build([RowInputs(SP(seed=0), [0], [], gen)], V, "meta")


def test_make_tensor_with_pad():
    t = make_tensor_with_pad([[5, 6, 7], [], [9]], 8, torch.device("cpu"))
    assert t.dtype == torch.int64
    assert t.tolist() == [[5, 6, 7], [8, 8, 8], [9, 8, 8]]
    assert make_tensor_with_pad([[], []], 8, torch.device("cpu")).shape == (2, 0)
    assert make_tensor_with_pad([], 8, torch.device("cpu")).shape == (0, 0)
    arrays = [np.array([5, 6, 7], dtype=np.int32), np.array([], dtype=np.int32), np.array([9])]
    assert make_tensor_with_pad(arrays, 8, torch.device("cpu")).tolist() == [[5, 6, 7], [8, 8, 8], [9, 8, 8]]


def test_numpy_rows_build_like_lists(make_md):
    p = [SP(repetition_penalty=1.2, frequency_penalty=0.5, min_tokens=3, stop_token_ids=[1])] * 2
    lists = make_md(p, V, prompts=[[1, 2], [3]], outputs=[[4], []])
    arrays = make_md(p, V, prompts=[np.array([1, 2]), np.array([3])], outputs=[np.array([4]), np.array([])])
    assert torch.equal(lists.prompt_token_ids, arrays.prompt_token_ids)
    assert lists.min_tokens == arrays.min_tokens == {0: (2, {1}), 1: (3, {1})}
