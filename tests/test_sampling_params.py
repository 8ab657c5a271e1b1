"""SamplingParams refuses, naming the field, every value the engine could not take: a value that
passed here but failed in the engine process would kill the engine (its msgpack decoder) or the
sender thread (an integer msgpack cannot hold), and every request after it would hang or fail.
Found by the request fuzzer (tests/reliability/fuzz_requests.py)."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm.engine.messages import EngineCoreRequest, encode
from pagedllm.sampling_params import MAX_INT, SamplingParams


def roundtrip(params: SamplingParams) -> SamplingParams:
    """What the engine process decodes from a request sent to it (engine/messages.py's encoder)."""
    req = EngineCoreRequest("r", [1, 2], params, 0.0, None, sorted(params.all_stop_token_ids))
    return msgspec.msgpack.Decoder(EngineCoreRequest).decode(encode(req)).sampling_params


@pytest.mark.parametrize(
    "kwargs, words",
    [
        # killed the engine process: msgspec's decoder found a str where the annotation says bool
        ({"structured_outputs": {"json_object": "yes"}}, ["structured_outputs.json_object", "true or false"]),
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}}, ["disable_any_whitespace"]),
        ({"structured_outputs": {"json": {"type": "object"}, "disable_additional_properties": [1]}},
         ["disable_additional_properties"]),
        ({"structured_outputs": {"regex": "a", "disable_fallback": 1}}, ["disable_fallback"]),
        ({"skip_special_tokens": "no"}, ["skip_special_tokens", "true or false"]),
        ({"ignore_eos": 1}, ["ignore_eos"]),
        ({"include_stop_str_in_output": None}, ["include_stop_str_in_output"]),
        # AttributeError ('int' object has no attribute 'split'), a 500 on the server
        ({"structured_outputs": {"regex": "a", "backend": 5}}, ["structured_outputs.backend", "string"]),
        # OverflowError in the frontend's sender thread: the request hung, and every one after it
        ({"top_k": 10**30}, ["top_k", "2**63 - 1"]),
        ({"truncate_prompt_tokens": 2**63}, ["truncate_prompt_tokens"]),
        ({"max_tokens": 10**20}, ["max_tokens"]),
        ({"prompt_logprobs": 10**30}, ["prompt_logprobs"]),
    ],
)
def test_values_the_engine_cannot_take_are_refused_by_name(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value), e.value


@pytest.mark.parametrize(
    "kwargs, exc, words",
    [
        # TypeError "'int' object is not iterable" / "object of type 'int' has no len()" named nothing
        ({"stop": 5}, TypeError, ["stop must be"]),
        ({"stop_token_ids": 7}, TypeError, ["stop_token_ids"]),
        ({"bad_words": 3}, TypeError, ["bad_words"]),
        ({"allowed_token_ids": 5}, TypeError, ["allowed_token_ids"]),
        # AttributeError ('list' object has no attribute 'items')
        ({"logit_bias": [1, 2]}, TypeError, ["logit_bias must be a dict"]),
        ({"logit_bias": "1"}, TypeError, ["logit_bias must be a dict"]),
        # silently accepted: bytes read as ids (b"\x01" -> [1]), a float key truncated (1.5 -> 1)
        ({"stop_token_ids": b"\x01"}, TypeError, ["stop_token_ids"]),
        ({"logit_bias": {1.5: 1.0}}, ValueError, ["logit_bias keys", "1.5"]),
        ({"logit_bias": {None: 1.0}}, ValueError, ["logit_bias keys"]),
        ({"stop": {"a": 1}}, TypeError, ["stop must be"]),
    ],
)
def test_wrong_container_types_name_the_field(kwargs, exc, words):
    with pytest.raises(exc) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value), e.value


def test_accepted_edge_values_reach_the_engine_unchanged():
    """Whatever SamplingParams accepts, the engine process can decode: the largest ints, iterables
    other than lists (as vLLM's list(...)), string token-id keys of logit_bias (JSON's)."""
    p = SamplingParams(top_k=MAX_INT, seed=2**64 - 1, max_tokens=MAX_INT, stop=("a", "b"), stop_token_ids={3},
                       bad_words=("x",), allowed_token_ids=(1, 2), logit_bias={"5": 1, 6: -2.5},
                       structured_outputs={"regex": "[ab]+", "backend": "xgrammar", "disable_any_whitespace": True})
    back = roundtrip(p)
    assert back.top_k == MAX_INT and back.seed == 2**64 - 1 and back.max_tokens == MAX_INT
    assert back.stop == ["a", "b"] and back.stop_token_ids == [3] and back.bad_words == ["x"]
    assert back.allowed_token_ids == [1, 2] and back.logit_bias == {5: 1.0, 6: -2.5}
    assert back.structured_outputs.regex == "[ab]+" and back.structured_outputs.disable_any_whitespace is True


def test_clone_shares_nothing_mutable_and_equals_the_original():
    from pagedllm.structured_output.params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[7], logit_bias={3: 1.5},
                       allowed_token_ids=[1, 2], bad_words=["no"], structured_outputs=StructuredOutputsParams(
                           json=schema))
    p.bad_words_token_ids = [[4, 5]]
    c = p.clone()
    assert c == p and c is not p
    # Mutating every container of the copy, nested ones included, leaves the original as it was.
    c.stop.append("y")
    c.stop_token_ids.append(8)
    c.logit_bias[9] = 0.0
    c.allowed_token_ids.append(3)
    c.bad_words.append("never")
    c.bad_words_token_ids[0].append(6)
    c.all_stop_token_ids.add(99)
    c.structured_outputs.json["properties"]["b"] = {"type": "string"}
    assert p.stop == ["x"] and p.stop_token_ids == [7] and p.logit_bias == {3: 1.5}
    assert p.allowed_token_ids == [1, 2] and p.bad_words == ["no"] and p.bad_words_token_ids == [[4, 5]]
    assert p.all_stop_token_ids == {7}
    assert list(p.structured_outputs.json["properties"]) == ["a"]


def test_vllms_spellings_of_no_seed_and_one_logprob():
    """vLLM reads seed=-1 as no seed (it was a generator seeded with -1: every "unseeded" request the
    same) and logprobs=True as 1 (it was refused)."""
    p = SamplingParams(seed=-1, logprobs=True, prompt_logprobs=True)
    assert p.seed is None and p.logprobs == 1 and p.prompt_logprobs == 1
    assert roundtrip(p).seed is None
    assert SamplingParams(seed=-2).seed == -2
