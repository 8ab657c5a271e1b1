"""pooling/offline.py (LLM.embed / encode / score) on calls h61's fuzzer made
(tests/reliability/fuzz_offline.py): each raised something that was no ValueError / TypeError, or
one that named nothing the caller wrote."""

from __future__ import annotations

import pytest

from pagedllm.pooling.params import PoolingParams
from tests.utils import assert_pool_idle


@pytest.fixture(scope="module")
def llm():
    from pagedllm import LLM

    return LLM("sentence-transformers/all-MiniLM-L6-v2", max_num_seqs=4)


@pytest.mark.parametrize("pooling_params", ["x", 5, [None], [PoolingParams(), "x"]])
def test_pooling_params_of_the_wrong_type_are_a_type_error(llm, pooling_params):
    """Was AttributeError: 'str' object has no attribute 'clone'."""
    with pytest.raises(TypeError, match="pooling_params must be a PoolingParams"):
        llm.embed("hi", pooling_params=pooling_params, use_tqdm=False)


@pytest.mark.parametrize("prompts", [None, 5, b"ab"])
def test_prompts_of_the_wrong_type_name_prompts(llm, prompts):
    """Was TypeError: 'NoneType' object is not iterable."""
    with pytest.raises(TypeError, match="prompts must be"):
        llm.embed(prompts, use_tqdm=False)


@pytest.mark.parametrize("truncate", [10**6, 10**30])
def test_truncation_past_the_context_is_a_value_error(llm, truncate):
    """Was OverflowError out of the tokenizer (int too big to convert) at 10**30."""
    for call in (lambda: llm.embed(["a", "b"], truncate_prompt_tokens=truncate, use_tqdm=False),
                 lambda: llm.score("a", ["b"], truncate_prompt_tokens=truncate, use_tqdm=False)):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            call()
        assert_pool_idle(llm)


@pytest.mark.parametrize("task", ["nope", 5])
def test_a_bad_pooling_task_is_named_as_the_caller_named_it(llm, task):
    """Was "task must be one of ..." (PoolingParams' field, not encode's argument)."""
    with pytest.raises(ValueError, match="pooling_task must be one of"):
        llm.encode("hi", pooling_task=task, use_tqdm=False)


def test_score_refuses_a_dict_instead_of_reading_its_keys(llm):
    """score("q", {"prompt": "x"}) scored "q" against "prompt" (list() of a dict is its keys)."""
    with pytest.raises(ValueError, match="data_2 must be a string or a list of strings, got dict"):
        llm.score("q", {"prompt": "x"}, use_tqdm=False)
    assert len(llm.score("q", ("a", "b"), use_tqdm=False)) == 2
