"""StructuredOutputManager's bookkeeping, with a small backend written here (a grammar of exactly
three digit tokens, then the stop token): queued tokens reach a grammar only through a bitmask
job, in order; a finished or removed request's tokens never do; only rows whose next token is
constrained get a bitmask row; the job on the bitmask thread gives what the caller's thread does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.structured_output.bitmask import unpack_bitmask
from pagedllm.structured_output.manager import StructuredOutputManager

DIGITS, STOP, VOCAB = list(range(10)), 39, 40


class ThreeDigits(StructuredOutputGrammar):
    stop_ids = frozenset({STOP})  # known stop tokens: the manager's one-token fast path runs

    def __init__(self) -> None:
        self.seen: list[int] = []

    def allowed(self) -> list[int]:
        return DIGITS if len(self.seen) < 3 else [STOP]

    def accept_tokens(self, tokens: list[int]) -> bool:
        for t in tokens:
            if self.is_terminated() or t not in self.allowed():
                return False
            self.seen.append(t)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        words = [0] * bitmask.shape[1]
        for t in self.allowed():
            words[t // 32] |= 1 << (t % 32)
        bitmask[row] = torch.tensor(words, dtype=torch.int64).to(torch.int32)

    def is_terminated(self) -> bool:
        return self.seen[-1:] == [STOP]


class ThreeDigitsBackend(StructuredOutputBackend):
    vocab_size = VOCAB

    def validate(self, params):
        pass

    def compile_grammar(self, params, stop_token_ids):
        return ThreeDigits()


def make_manager(*rids: str, reasoning_end: int | None = None) -> StructuredOutputManager:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=4),
                             device_config=SimpleNamespace(device="cpu"))
    manager = StructuredOutputManager(config)
    manager._backend = ThreeDigitsBackend()
    for rid in rids:
        params = StructuredOutputsParams(regex="[0-9]{3}")
        if reasoning_end is not None:
            params._reasoning_end_token_ids = [reasoning_end]
        sp = SamplingParams(structured_outputs=params)
        manager.add_request(SimpleNamespace(request_id=rid, sampling_params=sp)).future.result()
    return manager


def step(*rids: str):
    return SimpleNamespace(num_scheduled_tokens=dict.fromkeys(rids, 1), sampling_req_ids=set(rids))


def allowed_rows(go) -> dict[str, list[int]]:
    mask = unpack_bitmask(go.grammar_bitmask, VOCAB)
    return {rid: mask[i].nonzero().flatten().tolist() for i, rid in enumerate(go.structured_output_request_ids)}


def test_tokens_reach_grammars_only_through_a_job_in_order():
    manager = make_manager("a", "b", "c")
    grammar = {rid: manager.requests[rid].grammar for rid in "abc"}
    manager.advance([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [2]), EngineCoreOutput("c", [3])])
    manager.advance([EngineCoreOutput("a", [4]), EngineCoreOutput("plain", [7])])  # a collected twice
    assert all(g.seen == [] for g in grammar.values())
    go = manager.grammar_bitmask(step("plain", "a", "b"))
    assert grammar["a"].seen == [1, 4] and grammar["b"].seen == [2] and grammar["c"].seen == [3]
    assert allowed_rows(go) == {"a": DIGITS, "b": DIGITS}  # batch order; no row for "plain"
    manager.advance([EngineCoreOutput("a", [5]), EngineCoreOutput("b", [6])])
    go = manager.submit_grammar_bitmask(step("a", "b")).result()
    assert allowed_rows(go) == {"a": [STOP], "b": DIGITS}
    assert manager.requests["a"].grammar.seen == [1, 4, 5]


def test_dropped_tokens_never_reach_a_grammar_and_free_rows_get_none():
    manager = make_manager("done", "aborted", "ended")
    grammar = {rid: manager.requests[rid].grammar for rid in manager.requests}
    manager.advance([EngineCoreOutput("ended", [1, 2, 3, STOP]), EngineCoreOutput("aborted", [8])])
    manager.remove(["aborted"])
    manager.advance([EngineCoreOutput("done", [9], finish_reason="length")])
    assert manager.grammar_bitmask(step("ended")) is None  # its grammar ended: nothing to mask
    assert grammar["done"].seen == [] and grammar["aborted"].seen == []
    assert grammar["ended"].is_terminated() and set(manager.requests) == {"ended"}


def test_a_refused_token_is_reported_and_leaves_its_grammar():
    manager = make_manager("a", "b")
    manager.advance([EngineCoreOutput("a", [1]), EngineCoreOutput("b", [STOP])])  # STOP: not after 0 digits
    go = manager.grammar_bitmask(step("a", "b"))
    assert manager.requests["a"].grammar.seen == [1] and manager.requests["b"].grammar.seen == []
    assert allowed_rows(go) == {"a": DIGITS, "b": DIGITS}


def test_xgrammar_batch_accept_reports_refusals_only():
    import xgrammar as xgr

    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, XgrammarGrammar

    vocab = ["a", "b", "c", "</s>"]
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[3])
    compiled = xgr.GrammarCompiler(info).compile_regex("[ab]*")
    grammars = [XgrammarGrammar(xgr.GrammarMatcher(compiled)) for _ in range(3)]
    backend = object.__new__(XgrammarBackend)  # accept_tokens_batch needs no tokenizer
    assert backend.accept_tokens_batch(grammars, [0, 1, 0]) is None
    assert backend.accept_tokens_batch(grammars, [0, 2, 3]) == [True, False, True]
    assert [g.is_terminated() for g in grammars] == [False, False, True]
    assert grammars[2].may_terminate(3) and not grammars[2].may_terminate(0)


def test_reasoning_text_is_free_and_the_tokens_after_its_end_reach_the_grammar():
    END = 30
    manager = make_manager("r", reasoning_end=END)
    grammar = manager.requests["r"].grammar
    manager.advance([EngineCoreOutput("r", [20, 21])])
    assert manager.grammar_bitmask(step("r")) is None and grammar.seen == []  # thinking: no row
    manager.advance([EngineCoreOutput("r", [22, END, 5])])  # the end and a first answer token in one step
    go = manager.submit_grammar_bitmask(step("r")).result()
    assert grammar.seen == [5] and allowed_rows(go) == {"r": DIGITS}
    manager.advance([EngineCoreOutput("r", [6])])  # from here the one-token fast path
    manager.grammar_bitmask(step("r"))
    assert grammar.seen == [5, 6]


def test_one_token_steps_end_the_grammar_at_its_stop_token():
    # Decode steps take the one-token batch path; the stop token takes the slow one, which ends it.
    manager = make_manager("a")
    assert allowed_rows(manager.grammar_bitmask(step("a"))) == {"a": DIGITS}  # the prefill's step
    for t in (1, 2, 3):
        manager.advance([EngineCoreOutput("a", [t])])
        assert manager._to_accept_one and not manager._to_accept
        go = manager.submit_grammar_bitmask(step("a")).result()
    assert allowed_rows(go) == {"a": [STOP]}
    manager.advance([EngineCoreOutput("a", [STOP])])
    assert manager._to_accept and not manager._to_accept_one
    assert manager.submit_grammar_bitmask(step("a")).result() is None  # ended: the next token is free
    assert manager.requests["a"].grammar.is_terminated() and manager.requests["a"].active_grammar is None
    manager.shutdown()


def test_the_bitmask_thread_runs_jobs_in_turn_and_reports_their_errors():
    import pytest

    from pagedllm.structured_output.fill_thread import FillThread

    thread, seen = FillThread(), []
    for i in range(3):
        thread.submit(lambda i=i: seen.append(i))
        with pytest.raises(RuntimeError, match="busy"):
            thread.submit(lambda: None)
        thread.wait()
    assert seen == [0, 1, 2]
    thread.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        thread.wait()
    thread.wait()  # nothing submitted: returns at once
    thread.close()
    assert not thread._thread.is_alive()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [1, 3], [4]], ids=["all", "some", "last"])
def test_the_cpu_bitmask_lookup_masks_as_the_reference(dtype, rows):
    # apply_grammar_bitmask_lut (the CPU path) against apply_grammar_bitmask_ref: random bitmasks, a
    # vocabulary that ends inside a word (70: 3 words), logits that are -inf already in places.
    from pagedllm.structured_output.bitmask import apply_grammar_bitmask_lut, apply_grammar_bitmask_ref

    g = torch.Generator().manual_seed(len(rows))
    logits = torch.randn(5, 70, generator=g).to(dtype)
    logits[2, 5] = float("-inf")
    bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), 3), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # every token of the first word allowed
    want = apply_grammar_bitmask_ref(logits.clone(), bitmask, rows)
    got = apply_grammar_bitmask_lut(logits.clone(), bitmask, rows)
    assert torch.equal(got, want)
    assert torch.isinf(want).any() and not torch.isnan(got).any()


def test_the_grammar_backend_defaults(monkeypatch):
    # Unset or 0: the bitmask thread, gated or not, on any host; 1: the grammar worker processes.
    from pagedllm.structured_output import backend_select as manager_mod

    for var in ("PAGEDLLM_GRAMMAR_WORKER", "PAGEDLLM_GRAMMAR_SPIN", "PAGEDLLM_GRAMMAR_GATE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(manager_mod.os, "cpu_count", lambda: 16)
    assert not manager_mod.use_grammar_worker()
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_WORKER", "1")
    assert manager_mod.use_grammar_worker()
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_WORKER", "0")
    assert not manager_mod.use_grammar_worker()


def _gates_made(llm, monkeypatch) -> int:
    """How many steps of one constrained request got a gate (manager.gate_step, asked by the engine
    core only when it gates; None: that step samples after its fill)."""
    manager = llm.llm_engine.engine_core.structured_output_manager
    gates = []
    gate_step = manager.gate_step

    def spy(so):
        gates.append(gate_step(so))
        return gates[-1]
    monkeypatch.setattr(manager, "gate_step", spy)
    llm.generate(["a b c"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-f]{4}")))
    return sum(g is not None for g in gates)


def test_gated_sampling_is_off_by_default_on_the_cpu(monkeypatch):
    """Unset, PAGEDLLM_GRAMMAR_GATE gates on CUDA only (engine_core); the CPU samples after the fill."""
    from pagedllm import LLM
    from tests.utils import tiny_model

    monkeypatch.delenv("PAGEDLLM_GRAMMAR_GATE", raising=False)
    path, _ = tiny_model("qwen3", vocab_size=49152, with_tokenizer=True)
    llm = LLM(model=path, max_model_len=128, num_gpu_blocks_override=16, async_scheduling=True)
    try:
        assert not llm.llm_engine.engine_core.gate_sampling
        assert _gates_made(llm, monkeypatch) == 0
    finally:
        llm.llm_engine.shutdown()
    monkeypatch.setenv("PAGEDLLM_GRAMMAR_GATE", "1")
    llm = LLM(model=path, max_model_len=128, num_gpu_blocks_override=16, async_scheduling=True)
    try:
        assert llm.llm_engine.engine_core.gate_sampling
        assert _gates_made(llm, monkeypatch) > 0
    finally:
        llm.llm_engine.shutdown()
