"""Constrained decoding in the engine: the embedded SmolLM2 (CPU), offline API.

Constrained and unconstrained requests share batches; with async scheduling on and off the
constrained outputs match their constraint and the unconstrained greedy tokens equal a run without
the constrained neighbours, token for token.
"""

from __future__ import annotations

import json
import re

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from tests.structured_output.schemas import PERSON_SCHEMA
from tests.utils import assert_pool_idle

SCHEMA = PERSON_SCHEMA
QUESTIONS = ["Describe a person.", "What is the capital of France?", "Name a color.", "Count to five."]


@pytest.fixture(scope="module", params=[True], ids=["async"])  # sync: the CPU default, which the server tests run
def llm(request):
    llm = LLM(max_model_len=512, num_gpu_blocks_override=128, async_scheduling=request.param)
    yield llm
    del llm


def chat_prompts(llm, questions):
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in questions]


def test_mixed_batch(llm):
    prompts = chat_prompts(llm, QUESTIONS)
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(prompts[1:3], plain, use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
        plain,
        plain,
        SamplingParams(temperature=0.9, seed=1, max_tokens=16,
                       guided_decoding=GuidedDecodingParams(regex=r"[0-9]{3}-[a-z]{2,4}")),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    data = json.loads(outs[0].outputs[0].text)
    assert set(data) == {"name", "age"} and isinstance(data["age"], int) and 0 <= data["age"] <= 120
    assert outs[0].outputs[0].finish_reason == "stop"  # EOS only once the JSON is complete
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[3].outputs[0].text)
    for a, b in zip(alone, outs[1:3]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert_pool_idle(llm)


def test_the_bitmask_job_before_the_launch_gives_the_same_tokens(llm):
    # EngineCore.submit_before_launch (the step order's A/B, off by default): the step in flight is
    # collected and the job submitted before the launch; greedy outputs stay token for token.
    prompts = chat_prompts(llm, QUESTIONS[:2])
    params = [SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
              SamplingParams(temperature=0, max_tokens=12)]
    core = llm.llm_engine.engine_core
    before = llm.generate(prompts, params, use_tqdm=False)
    core.submit_before_launch = True
    try:
        after = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.submit_before_launch = False
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert_pool_idle(llm)


def test_choice_always_matches(llm):
    choices = ["yes", "no", "it depends"]
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=8, n=6,
                        structured_outputs=StructuredOutputsParams(choice=choices))
    out = llm.generate(chat_prompts(llm, ["Is the sky blue?"]), sp, use_tqdm=False)[0]
    assert len(out.outputs) == 6
    assert all(c.text in choices for c in out.outputs)


def test_bad_constraints_are_refused_before_queueing(llm):
    prompt = chat_prompts(llm, ["hi"])
    for so, words in [
        (StructuredOutputsParams(regex="(abc"), "parenthesis"),
        (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutputsParams(grammar="root ::= foo"), "foo"),
        (StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "nope"}}}'), "nope"),
    ]:
        with pytest.raises(ValueError, match=words):
            llm.generate(prompt, SamplingParams(structured_outputs=so), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not available"):
        SamplingParams(guided_decoding=GuidedDecodingParams(regex="a", backend="outlines"))
    assert_pool_idle(llm)


def test_masks_that_leave_the_grammar_no_token_end_the_request_with_an_error(llm):
    # The grammar and another mask together leave no token at some output token (not visible before
    # queueing): that request ends there with finish_reason "error" naming the mask, none of its tokens
    # breaks the grammar, the rows beside it keep their greedy tokens, and every KV block comes back.
    tok = llm.get_tokenizer()
    prompts = chat_prompts(llm, QUESTIONS)
    plain = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.generate(prompts[1:3], plain, use_tqdm=False)
    cases = [
        # "[0-9]{2}": after two digits only EOS is allowed, which min_tokens=6 still bans
        (SamplingParams(temperature=0, max_tokens=20, min_tokens=6, structured_outputs=StructuredOutputsParams(
            regex="[0-9]{2}")), "min_tokens", r"[0-9]{1,2}"),
        # "{" is allowed first; the grammar's next token (a quote, "}" or a space) is not (sampled rows too)
        (SamplingParams(temperature=0.8, seed=5, max_tokens=20, allowed_token_ids=tok.encode("{", add_special_tokens=False),
                        structured_outputs=StructuredOutputsParams(json_object=True)), "allowed_token_ids", r"\{"),
    ]
    for params, mask, text in cases:
        outs = llm.generate(prompts[:3], [params, plain, plain], use_tqdm=False)
        out = outs[0].outputs[0]
        assert out.finish_reason == "error", (out.text, out.finish_reason)
        assert mask in out.stop_reason and "no token" in out.stop_reason, out.stop_reason
        assert re.fullmatch(text, out.text), out.text
        for a, b in zip(alone, outs[1:]):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_pool_idle(llm)
        assert llm.llm_engine.engine_core.structured_output_manager._num_checked == 0  # nothing checked now


@pytest.mark.parametrize("params, words", [
    (dict(min_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])), "min_tokens=4"),
    (dict(bad_words=["{"], structured_outputs=StructuredOutputsParams(choice=["{", "{"])), "bad_words"),
    (dict(structured_outputs=StructuredOutputsParams(grammar="root ::= root")), "'root'"),
    (dict(structured_outputs=StructuredOutputsParams(regex="x[^\\s\\S]")), "matches no string"),
])
def test_conflicts_seen_before_queueing_are_refused(llm, params, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate("hi", SamplingParams(max_tokens=8, **params), use_tqdm=False)
    assert_pool_idle(llm)
