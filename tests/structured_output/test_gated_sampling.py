"""Gated sampling (structured_output/gate.py) on the CPU, a tiny random Qwen3 with SmolLM2's tokenizer,
async scheduling: a constrained step samples with its launch and waits for its bitmask.

The bitmask fill is made 5 ms late here, so a step that sampled before its fill would read the
buffer's stale rows (all ones at first, then an older step's): its tokens would leave the grammar
(a random model's tokens almost never follow it). Every constrained token is checked with a fresh
xgrammar matcher; the last test shows that check failing once the wait is taken out.
"""

from __future__ import annotations

import re
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import gate as gate_mod
from tests.utils import assert_pool_idle, tiny_model

CHOICE = "the quick brown fox jumps over the lazy dog"
REGEX = r"[a-f]{3}-[0-9]{4}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 6}},
          "required": ["n", "s"], "additionalProperties": False}
PROMPTS = ["a b c", "one two three four", "x", "hello there"]


def make_llm(max_model_len: int = 256, **kw) -> LLM:
    path, _ = tiny_model("qwen3", vocab_size=49152, with_tokenizer=True)
    return LLM(model=path, max_model_len=max_model_len, async_scheduling=True, **kw)


@pytest.fixture(scope="module")
def llm():
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDLLM_GRAMMAR_GATE", "1")  # opt-in (envs.py)
    try:
        llm = make_llm(num_gpu_blocks_override=64)
    finally:
        mp.undo()
    assert llm.llm_engine.engine_core.gate_sampling
    yield llm
    llm.llm_engine.shutdown()


def slow_fills(llm, monkeypatch) -> None:
    """Every bitmask fill on the thread starts 5 ms late."""
    backend = llm.llm_engine.engine_core.structured_output_manager.backend()
    fill_job = backend.fill_job

    def late(*args, **kwargs):
        job = fill_job(*args, **kwargs)

        def run():
            time.sleep(0.005)
            job()
        return run

    monkeypatch.setattr(backend, "fill_job", late)


def refused(llm, params: StructuredOutputsParams, token_ids: list[int]) -> int | None:
    """The index of the first token a fresh matcher of `params` refuses, or None."""
    manager = llm.llm_engine.engine_core.structured_output_manager
    grammar = manager.backend().compile_grammar(params, [llm.get_tokenizer().eos_token_id])
    for i, t in enumerate(token_ids):
        if not grammar.matcher.accept_token(t):
            return i
    return None


def constrained_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, structured_outputs=StructuredOutputsParams(choice=[CHOICE])),
        SamplingParams(temperature=1.0, seed=2, max_tokens=12, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    ]


@pytest.mark.parametrize("accept_on_thread", [False, True], ids=["accept in the loop", "accept on the thread"])
def test_gated_steps_emit_only_tokens_their_mask_allows(llm, monkeypatch, accept_on_thread):
    slow_fills(llm, monkeypatch)
    monkeypatch.setattr(llm.llm_engine.engine_core.structured_output_manager, "accept_on_thread", accept_on_thread)
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = llm.generate(PROMPTS[3:], greedy, use_tqdm=False)
    runner.gate_waits.clear()
    params = constrained_params()
    outs = llm.generate(PROMPTS, params + [greedy], use_tqdm=False)
    assert runner.gate_waits.get("host", 0) >= 10  # the constrained steps were gated
    for out, p in zip(outs[:3], params):
        assert refused(llm, p.structured_outputs, list(out.outputs[0].token_ids)) is None, out.outputs[0].text
    assert outs[0].outputs[0].text == CHOICE
    assert outs[1].outputs[0].finish_reason != "stop" or re.fullmatch(REGEX, outs[1].outputs[0].text)
    # The unconstrained greedy row shared the gated batches; its tokens are those it has alone.
    assert outs[3].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_pool_idle(llm)


def test_finishing_and_aborted_requests_mid_gate(llm, monkeypatch):
    slow_fills(llm, monkeypatch)
    engine = llm.llm_engine
    params = constrained_params()
    short = SamplingParams(temperature=1.0, seed=4, max_tokens=3, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    for i, p in enumerate(params + [short, params[2]]):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], p)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
        if steps == 4:
            engine.abort_request("r4")  # between two gated steps, its row in the step in flight
    assert "r4" not in done and set(done) == {"r0", "r1", "r2", "r3"}
    assert len(done["r3"].outputs[0].token_ids) == 3
    for rid, p in zip(("r0", "r1", "r2", "r3"), params + [short]):
        assert refused(llm, p.structured_outputs, list(done[rid].outputs[0].token_ids)) is None
    assert not engine.engine_core.structured_output_manager.requests
    assert_pool_idle(llm)


def test_preempted_constrained_requests_stay_valid(llm, monkeypatch):
    # 40 requests of ~30 tokens (2 blocks each) in 64 blocks of 16 tokens: the scheduler preempts.
    slow_fills(llm, monkeypatch)
    scheduler = llm.llm_engine.engine_core.scheduler
    before = scheduler.num_preemptions
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=26, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(regex="(ab|cd|ef){100}")) for s in range(40)]
    outs = llm.generate([PROMPTS[i % 4] for i in range(40)], params, use_tqdm=False)
    assert scheduler.num_preemptions > before
    for out, p in zip(outs, params):
        assert len(out.outputs[0].token_ids) == 26
        assert refused(llm, p.structured_outputs, list(out.outputs[0].token_ids)) is None, out.outputs[0].text
    assert_pool_idle(llm)


def test_without_the_wait_stale_masks_are_caught(llm, monkeypatch):
    # The check above is not vacuous: a gated step that samples before its fill emits refused tokens.
    slow_fills(llm, monkeypatch)
    monkeypatch.setattr(gate_mod, "host_wait", lambda gate, timeout_s=0: None)
    params = constrained_params()
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert any(refused(llm, p.structured_outputs, list(o.outputs[0].token_ids)) is not None
               for o, p in zip(outs, params))
    time.sleep(0.1)  # the last late fill ends before the next test's engine use
