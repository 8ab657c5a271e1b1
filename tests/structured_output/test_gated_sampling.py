"""Gated sampling (structured_output/gate.py) on the CPU, a tiny random Qwen3 with SmolLM2's tokenizer,
async scheduling: a constrained step samples with its launch and waits for its bitmask.

Each test runs with each filler: the bitmask thread, two grammar worker processes with their jobs
on the socket, and the same with their jobs through the job areas (PAGEDLLM_GRAMMAR_SPIN). On the
thread the bitmask fill is made 5 ms late, so a step that sampled before its fill would read the
buffer's stale rows (all ones at first, then an older step's): its tokens would leave the grammar
(a random model's tokens almost never follow it). Every constrained token is checked with a fresh
xgrammar matcher; the stale-mask test shows that check failing once the wait is taken out. A dead
grammar worker aborts the constrained requests in flight, and the engine goes on.
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


FILLERS = {"thread": {"PAGEDLLM_GRAMMAR_WORKER": "0"},
           "workers": {"PAGEDLLM_GRAMMAR_WORKER": "1", "PAGEDLLM_GRAMMAR_WORKERS": "2", "PAGEDLLM_GRAMMAR_SPIN": "0"},
           "workers-spin": {"PAGEDLLM_GRAMMAR_WORKER": "1", "PAGEDLLM_GRAMMAR_WORKERS": "2",
                            "PAGEDLLM_GRAMMAR_SPIN": "1"}}


def gated_llm(filler: str, **kw) -> LLM:
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDLLM_GRAMMAR_GATE", "1")
    for k, v in FILLERS[filler].items():
        mp.setenv(k, v)
    try:
        llm = make_llm(**kw)
        manager = llm.llm_engine.engine_core.structured_output_manager
        backend = manager.backend()  # built now, under this environment
    finally:
        mp.undo()
    assert llm.llm_engine.engine_core.gate_sampling
    assert manager._remote == (filler != "thread")
    assert getattr(backend, "spin", False) == (filler == "workers-spin")
    return llm


@pytest.fixture(scope="module", params=list(FILLERS))
def llm(request):
    llm = gated_llm(request.param, num_gpu_blocks_override=64)
    yield llm
    llm.llm_engine.shutdown()


def slow_fills(llm, monkeypatch) -> None:
    """Every bitmask fill on the thread starts 5 ms late (the workers' fills: as they come)."""
    backend = llm.llm_engine.engine_core.structured_output_manager.backend()
    if getattr(backend, "remote", False):
        return
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
    backend = llm.llm_engine.engine_core.structured_output_manager.backend()
    backend = getattr(backend, "local", backend)  # the grammar workers' backend: its in-process twin
    grammar = backend.compile_grammar(params, [llm.get_tokenizer().eos_token_id])
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
    manager = llm.llm_engine.engine_core.structured_output_manager
    if manager._remote and accept_on_thread:
        pytest.skip("the grammar workers accept in their process")
    slow_fills(llm, monkeypatch)
    monkeypatch.setattr(manager, "accept_on_thread", accept_on_thread)
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
    # The check above is not vacuous: a gated step that samples before its fill samples tokens its
    # grammar refuses; the grammar's refusal ends the request with an error (engine_core.step), or a
    # token refused after the request's last step stays in its output.
    if llm.llm_engine.engine_core.structured_output_manager._remote:
        pytest.skip("the late fill is made on the thread")
    slow_fills(llm, monkeypatch)
    monkeypatch.setattr(gate_mod, "host_wait", lambda gate, timeout_s=0: None)
    params = constrained_params()
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    errors = [o.outputs[0].stop_reason for o in outs if o.outputs[0].finish_reason == "error"]
    assert all("refused" in e for e in errors), errors
    assert errors or any(refused(llm, p.structured_outputs, list(o.outputs[0].token_ids)) is not None
                         for o, p in zip(outs, params))
    time.sleep(0.1)  # the last late fill ends before the next test's engine use


def test_many_gated_steps_mixed_with_free_rows_and_requests_joining(llm):
    # Hundreds of gated steps with requests joining and leaving at different steps: constrained rows of
    # three grammars beside free rows, each constrained output valid, the free greedy rows unchanged.
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    alone = llm.generate(PROMPTS, greedy, use_tqdm=False)
    params, prompts = [], []
    for i in range(24):
        so = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex="(ab|cd|ef){100}"),
              StructuredOutputsParams(choice=[CHOICE, "yes"])][i % 3]
        params.append(SamplingParams(temperature=1.0, seed=10 + i, max_tokens=8 + 5 * (i % 7), structured_outputs=so))
        prompts.append(PROMPTS[i % 4] + " " * (i % 5))
    runner.gate_waits.clear()
    outs = llm.generate(PROMPTS + prompts, [greedy] * 4 + params, use_tqdm=False)
    assert sum(runner.gate_waits.values()) >= 30
    for a, o in zip(alone, outs[:4]):
        assert o.outputs[0].token_ids == a.outputs[0].token_ids
    for o, p in zip(outs[4:], params):
        assert refused(llm, p.structured_outputs, list(o.outputs[0].token_ids)) is None, o.outputs[0].text
    assert_pool_idle(llm)


@pytest.mark.parametrize("spin", ["0", "1"])
def test_a_grammar_worker_that_dies_aborts_the_constrained_requests_and_the_engine_goes_on(spin):
    # Not a hang, and not the engine's end: the constrained requests in flight finish as aborted (their
    # grammars were in the workers), the free greedy row beside them keeps its tokens, and a later
    # constrained request is served by the in-process bitmask thread.
    llm = gated_llm("workers-spin" if spin == "1" else "workers", num_gpu_blocks_override=64)
    engine = llm.llm_engine
    try:
        greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        manager = engine.engine_core.structured_output_manager
        regex = StructuredOutputsParams(regex="(ab|cd|ef){100}")
        engine.add_request("free", PROMPTS[0], greedy)
        for i in range(3):
            engine.add_request(f"d{i}", PROMPTS[i + 1], SamplingParams(
                temperature=1.0, seed=i, max_tokens=200, ignore_eos=True, structured_outputs=regex))
        t, done, n = time.monotonic(), {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            n += 1
            if n == 20:
                manager.backend()._workers.procs[1].kill()
        assert time.monotonic() - t < 60
        assert [done[f"d{i}"].outputs[0].finish_reason for i in range(3)] == ["abort"] * 3
        assert done["free"].outputs[0].token_ids == alone
        assert not manager._remote and not engine.engine_core.waiting_for_grammar
        p = SamplingParams(temperature=1.0, seed=9, max_tokens=16, structured_outputs=StructuredOutputsParams(json=SCHEMA))
        out = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0]
        assert refused(llm, p.structured_outputs, list(out.token_ids)) is None, out.text
        assert not manager._remote  # the thread served it
        assert_pool_idle(llm)
    finally:
        engine.shutdown()


def test_reasoning_rows_move_steps_between_the_gated_and_the_main_path(llm):
    # A request still reasoning is not gated (the token in flight may end its reasoning): steps with
    # such rows take main's path, the next ones are gated again. The end token here is any of a few
    # thousand ids, so each request's reasoning ends after a random number of steps.
    end_ids = list(range(7, 49152, 13))
    params = []
    for i in range(8):
        so = StructuredOutputsParams(json=SCHEMA) if i % 2 else StructuredOutputsParams(regex="(ab|cd|ef){100}")
        so._reasoning_end_token_ids = end_ids
        params.append(SamplingParams(temperature=1.0, seed=40 + i, max_tokens=30, ignore_eos=True, structured_outputs=so))
    runner = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner
    runner.gate_waits.clear()
    outs = llm.generate([PROMPTS[i % 4] for i in range(8)], params, use_tqdm=False)
    assert runner.gate_waits and sum(runner.gate_waits.values()) < 30  # some steps gated, not all
    ended = 0
    for o, p in zip(outs, params):
        ids = list(o.outputs[0].token_ids)
        first = next((j for j, t in enumerate(ids) if t in set(end_ids)), None)
        if first is None:
            continue  # still reasoning at the end: unconstrained throughout
        ended += 1
        plain = StructuredOutputsParams(**{k: getattr(p.structured_outputs, k) for k in ("json", "regex")})
        assert refused(llm, plain, ids[first + 1:]) is None, o.outputs[0].text
    assert ended >= 6
    assert_pool_idle(llm)


def test_a_gated_row_whose_masks_leave_no_token_ends_with_an_error(llm):
    # sample_check.py on gated steps (the gate's rows and bitmask): "[0-9]{2}" at min_tokens=5 leaves only
    # EOS after two digits, which min_tokens bans. The request ends with finish_reason "error" before a
    # token that breaks the grammar is emitted; the greedy row beside it keeps its tokens.
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    conflict = SamplingParams(temperature=1.0, seed=4, max_tokens=16, min_tokens=5,
                              structured_outputs=StructuredOutputsParams(regex="[0-9]{2}"))
    outs = llm.generate(PROMPTS[:2], [greedy, conflict], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone
    out = outs[1].outputs[0]
    assert out.finish_reason == "error" and "min_tokens" in out.stop_reason, (out.text, out.stop_reason)
    assert refused(llm, conflict.structured_outputs, list(out.token_ids)) is None, out.text
    assert_pool_idle(llm)
