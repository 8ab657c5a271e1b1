"""pooling/score.make_pairs: vLLM's 1 -> N and N -> N pairings, and errors that name the caller's fields."""

from __future__ import annotations

import pytest

from pagedllm.pooling.score import PairsError, make_pairs


def test_one_to_n_and_n_to_n():
    assert make_pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert make_pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]


@pytest.mark.parametrize("left, right, names, name", [
    ([], ["a"], ("queries", "documents"), "queries"),
    (["a"], [], ("queries", "documents"), "documents"),
    (["a", "b"], ["a", "b", "c"], ("text_1", "documents"), "documents"),
    (["a"], [1], ("data_1", "data_2"), "data_2"),
])
def test_errors_name_the_side_as_the_caller_calls_it(left, right, names, name):
    """h61's fuzzer: /score with queries / documents answered "text_2 is empty" with param text_2,
    fields the request did not have; LLM.score's errors named text_1 / text_2 for data_1 / data_2."""
    with pytest.raises(PairsError) as raised:
        make_pairs(left, right, names)
    assert raised.value.name == name and name in str(raised.value)
    others = {"text_1", "text_2", "data_1", "data_2", "queries", "documents"} - set(names)
    assert not any(other in str(raised.value) for other in others), str(raised.value)


def test_cross_encoder_truncation_is_checked_before_the_tokenizer():
    """A cross-encoder server answered truncate_prompt_tokens=10**30 with a 500 (the tokenizer's
    OverflowError); serving_score.py now turns this ValueError into a 400 naming the field."""
    from transformers import AutoTokenizer

    from pagedllm.pooling.embedded import embedded_embedding_model_path
    from pagedllm.pooling.score import cross_encoder_prompt

    tok = AutoTokenizer.from_pretrained(embedded_embedding_model_path())
    for bad in (10**30, 513, 0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            cross_encoder_prompt(tok, "a b c", "d e f", bad, 512)
    assert len(cross_encoder_prompt(tok, "a b c", "d e f", 4, 512)["prompt_token_ids"]) == 4
    assert len(cross_encoder_prompt(tok, "a b c", "d e f", -1, 512)["prompt_token_ids"]) == 9  # [CLS] a b c [SEP] d e f [SEP]
