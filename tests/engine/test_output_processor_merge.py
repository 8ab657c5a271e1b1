"""OutputProcessor.process_outputs over several steps' outputs at once (AsyncLLM merges the steps that
queued while the frontend was behind): the same text, tokens and stop as step by step, one output per
request."""

from __future__ import annotations

import time

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.engine.output_processor import OutputProcessor, RequestState
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from tests.utils import smollm_tokenizer


def _processor(tok, stop: list[str] | None = None) -> OutputProcessor:
    op = OutputProcessor(tok)
    params = SamplingParams(max_tokens=100, stop=stop, output_kind=RequestOutputKind.DELTA)
    for rid in ("a", "b"):
        op.add_request(RequestState(rid, None, 0, None, [1, 2, 3], params, tok, time.time()))
    return op


def _steps(tok, text: str) -> list[list[EngineCoreOutput]]:
    ids = tok.encode(text, add_special_tokens=False)
    return [[EngineCoreOutput("a", [t]), EngineCoreOutput("b", [t])] for t in ids]


def _run(op: OutputProcessor, batches: list[list[EngineCoreOutput]]) -> tuple[dict[str, str], dict[str, list[int]],
                                                                              dict[str, str | None], int, dict[str, str]]:
    text: dict[str, str] = {"a": "", "b": ""}
    ids: dict[str, list[int]] = {"a": [], "b": []}
    reason: dict[str, str | None] = {"a": None, "b": None}
    stops: dict[str, str] = {}
    n_outputs = 0
    for batch in batches:
        results, s = op.process_outputs(batch)
        stops.update(s)
        for ro in results:
            n_outputs += 1
            text[ro.request_id] += ro.outputs[0].text
            ids[ro.request_id] += ro.outputs[0].token_ids
            reason[ro.request_id] = ro.outputs[0].finish_reason
    return text, ids, reason, n_outputs, stops


def test_merged_steps_give_the_text_and_tokens_of_steps_one_by_one_in_one_output_each():
    tok = smollm_tokenizer()
    steps = _steps(tok, " The capital of France is Paris, café 🤖 naïve.")
    one_by_one = _run(_processor(tok), steps)
    merged = _run(_processor(tok), [[o for s in steps[i:i + 3] for o in s] for i in range(0, len(steps), 3)])
    assert merged[:3] == one_by_one[:3]
    assert one_by_one[0]["a"] == tok.decode(tok.encode(" The capital of France is Paris, café 🤖 naïve.",
                                                      add_special_tokens=False))
    assert one_by_one[3] == 2 * len(steps)
    assert merged[3] == 2 * len(range(0, len(steps), 3))  # one output per request per batch


def test_a_stop_string_in_an_earlier_merged_step_drops_the_later_steps_tokens():
    tok = smollm_tokenizer()
    steps = _steps(tok, "one two three four five six")
    one_by_one = _run(_processor(tok, stop=["three"]), steps)
    merged = _run(_processor(tok, stop=["three"]), [[o for s in steps for o in s]])
    assert one_by_one[0]["a"] == "one two " and one_by_one[2]["a"] == "stop"
    assert merged[:3] == one_by_one[:3]
    # The tokens after the one that completed the stop string are not the request's: the engine
    # produced them before it heard of the stop.
    assert len(merged[1]["a"]) == len(tok.encode("one two three", add_special_tokens=False))
    assert merged[4] == {"a": "three", "b": "three"}
    assert merged[3] == 2
