"""Gated sampling's hang on the H200 (BENCHMARKS.md, issue 22, h48 round 2 and h52): an engine's first
constrained batch, its requests joining the gated batch step by step as their compiles end, never finished.

The cause: the device wait was queued (with the sampling launch) before the gate's fill job was posted,
and a host call in between that synchronizes the device (the masked sampling kernel's first load,
allocations for the new batch sizes of joining rows) waited for a fill that the same thread posts only
later. The CPU has no stream, so its gated step used to sample only when its tokens were needed, after
the post: the CPU tests could not see it. Under `gate.SYNC_AT_LAUNCH_S` a CPU gated step waits for its
gate right at its sampling launch, the device's worst case, and fails instead of hanging.

Also here: a gate whose filler dies or sticks is forced open by a watchdog after gate.GATE_TIMEOUT_S,
its constrained requests aborted (none of the tokens sampled under the unfilled bitmask emitted), the
free rows beside them unchanged, and the engine serves later constrained requests.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from pagedllm import SamplingParams
from pagedllm.engine.engine_core import EngineCore
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import gate as gate_mod
from pagedllm.structured_output.gate import FlagWords, GateWatchdog
from tests.structured_output.schemas import SCHEMAS
from tests.structured_output.test_gated_sampling import PROMPTS, gated_llm, refused
from tests.utils import assert_pool_idle

REGEX = StructuredOutputsParams(regex="(ab|cd|ef){100}")


# -- the flag words, without an engine ---------------------------------------------------------------
def test_force_open_marks_the_unfilled_gates_and_no_late_store_shuts_them():
    flags = FlagWords(torch.zeros(1, dtype=torch.int32), None)
    bitmask = torch.zeros(1, 4, dtype=torch.int32)
    g1, g2, g3 = (flags.next_gate(["r"], bitmask) for _ in range(3))
    flags.raise_words(g1.flags, g1.seq)  # gate 1 filled; 2 and 3 are not
    assert g1.is_open() and not g2.is_open() and flags.pending()
    flags.force_open("the filler is stuck")
    assert g2.is_open() and g3.is_open() and not flags.pending()
    assert not g1.forced() and g2.forced() and g3.forced()
    assert flags.failure == "the filler is stuck"
    flags.raise_words(g2.flags, g2.seq)  # the stuck filler's late store (seq 2 < 3): nothing lowered
    assert g3.is_open()
    g4 = flags.next_gate(["r"], bitmask)
    assert g4.forced() and not g4.is_open()  # issued after: forced as well once opened again
    flags.force_open("again")
    assert g4.is_open() and flags.failure == "the filler is stuck"


def test_the_thread_watchdog_forces_a_gate_left_shut(monkeypatch):
    monkeypatch.setattr(gate_mod, "GATE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(gate_mod, "WATCH_PERIOD_S", 0.05)
    flags = FlagWords(torch.zeros(1, dtype=torch.int32), None)
    watchdog = GateWatchdog(flags)
    try:
        bitmask = torch.zeros(1, 4, dtype=torch.int32)
        for _ in range(5):  # filled in time: never forced
            g = flags.next_gate(["r"], bitmask)
            time.sleep(0.1)
            flags.raise_words(g.flags, g.seq)
        assert flags.failure is None
        shut = flags.next_gate(["r"], bitmask)
        t = time.monotonic()
        gate_mod.host_wait(shut, timeout_s=10)
        assert 0.3 <= time.monotonic() - t < 5
        assert shut.forced() and "did not fill gated step 6" in flags.failure
    finally:
        watchdog.stop()


# -- the first constrained batch, its rows joining step by step ---------------------------------------
def joining_requests(n: int) -> list[SamplingParams]:
    """n requests of distinct schemas (each its own compile), the compile of request i made to end
    ~i * 15 ms later than it would (slow_compiles): they join the running batch over many steps."""
    return [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=False,
                           structured_outputs=StructuredOutputsParams(json=SCHEMAS[i])) for i in range(n)]


def slow_compiles(manager, monkeypatch, params: list[SamplingParams]) -> None:
    backend = manager.backend()
    compile_grammar = backend.compile_grammar
    delay = {id(p.structured_outputs): 0.015 * i for i, p in enumerate(params)}

    def late(so_params, stop_ids):
        grammar = compile_grammar(so_params, stop_ids)
        time.sleep(delay.get(id(so_params), 0.0))
        return grammar

    monkeypatch.setattr(backend, "compile_grammar", late)


def record_gates(manager, monkeypatch) -> list[int]:
    sizes: list[int] = []
    gate_step = manager.gate_step

    def recorded(so):
        gate = gate_step(so)
        if gate is not None:
            sizes.append(len(gate.request_ids))
        return gate

    monkeypatch.setattr(manager, "gate_step", recorded)
    return sizes


@pytest.mark.parametrize("filler", ["thread", "workers", "workers-spin"])
def test_a_first_constrained_batch_joining_step_by_step_finishes(filler, monkeypatch):
    # A fresh engine (its first constrained batch, each worker's first jobs), every gated CPU step waiting
    # for its gate at its sampling launch as the device may: 12 distinct schemas whose compiles end one
    # after another, beside one free greedy row.
    monkeypatch.setattr(gate_mod, "SYNC_AT_LAUNCH_S", 20.0)
    llm = gated_llm(filler, num_gpu_blocks_override=128)
    engine = llm.llm_engine
    try:
        manager = engine.engine_core.structured_output_manager
        runner = engine.engine_core.model_executor.driver_worker.model_runner
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        params = joining_requests(12)
        slow_compiles(manager, monkeypatch, params)
        sizes = record_gates(manager, monkeypatch)
        runner.gate_waits.clear()
        t = time.monotonic()
        outs = llm.generate(PROMPTS[:1] + [PROMPTS[i % 4] for i in range(12)], [greedy] + params, use_tqdm=False)
        assert time.monotonic() - t < 120
        assert len(set(sizes[:40])) >= 4, sizes[:40]  # rows joined the gated batch over several steps
        assert runner.gate_waits.get("host", 0) >= 20
        assert outs[0].outputs[0].token_ids == alone
        for o, p in zip(outs[1:], params):
            assert o.outputs[0].finish_reason != "abort"
            assert refused(llm, p.structured_outputs, list(o.outputs[0].token_ids)) is None, o.outputs[0].text
        assert_pool_idle(llm)
    finally:
        engine.shutdown()


def test_the_launch_wait_catches_a_wait_queued_before_its_job(monkeypatch):
    # The check above is not vacuous: with the old order, the CPU's stand-in for a synchronizing call in
    # the sampling launch finds the gate shut (its job not posted yet) and the step fails, where the
    # device hung.
    monkeypatch.setattr(gate_mod, "SYNC_AT_LAUNCH_S", 1.0)
    llm = gated_llm("thread", num_gpu_blocks_override=64)
    engine = llm.llm_engine
    monkeypatch.setattr(EngineCore, "_step_gated", gate_mod.step_gated_old_order)  # the order before h52
    try:
        with pytest.raises(RuntimeError, match="was not filled within 1 s"):
            llm.generate(PROMPTS[:2], joining_requests(2), use_tqdm=False)
    finally:
        flags = engine.engine_core.structured_output_manager._flags
        if flags is not None:
            flags.open_all()
        engine.shutdown()


# -- a filler that sticks: forced open, its requests aborted, nothing refused emitted ------------------
@pytest.mark.parametrize("filler", ["thread", "workers-spin"])
def test_a_stuck_filler_aborts_its_constrained_requests_and_the_engine_goes_on(filler, monkeypatch):
    monkeypatch.setattr(gate_mod, "GATE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(gate_mod, "WATCH_PERIOD_S", 0.05)
    llm = gated_llm(filler, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    release = threading.Event()
    stopped: list[int] = []
    try:
        manager = engine.engine_core.structured_output_manager
        backend = manager.backend()
        greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        stuck = {"now": False}
        if filler == "thread":
            fill_job = backend.fill_job

            def maybe_stuck(grammars, bitmask, rows=None):
                job = fill_job(grammars, bitmask, rows)
                hang = stuck["now"]  # decided here, in the step loop (the thread may start the job later)

                def run():
                    if hang:
                        bitmask.fill_(-1)  # torn: every token allowed, then the filler hangs
                        release.wait()
                    job()
                return run

            monkeypatch.setattr(backend, "fill_job", maybe_stuck)
        engine.add_request("free", PROMPTS[0], greedy)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200, ignore_eos=True, structured_outputs=REGEX)
                  for i in range(3)]
        for i, p in enumerate(params):
            engine.add_request(f"c{i}", PROMPTS[i + 1], p)
        tokens: dict[str, list[int]] = {}
        done, n, t = {}, 0, time.monotonic()
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
                if out.finished:
                    done[out.request_id] = out
            n += 1
            if n == 15:
                stuck["now"] = True
                if filler != "thread":
                    pid = backend._workers.procs[1].pid
                    os.kill(pid, signal.SIGSTOP)  # alive, but fills nothing
                    stopped.append(pid)
                    # The next gate's buffer (not the one of the step in flight, which may be filled
                    # already) allows every token where the stopped worker leaves its rows unfilled.
                    manager._bitmasks[manager._next_bitmask ^ 1].numpy().fill(-1)
            assert time.monotonic() - t < 90
        assert [done[f"c{i}"].outputs[0].finish_reason for i in range(3)] == ["abort"] * 3
        for i, p in enumerate(params):
            assert len(tokens[f"c{i}"]) >= 5  # they ran before the filler stuck
            assert refused(llm, p.structured_outputs, tokens[f"c{i}"]) is None  # none sampled unfilled
        assert done["free"].outputs[0].token_ids == alone
        assert manager._flags is None or manager._flags.failure is None
        p = SamplingParams(temperature=1.0, seed=9, max_tokens=16, structured_outputs=REGEX)
        out = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason != "abort" and refused(llm, p.structured_outputs, list(out.token_ids)) is None
        assert not manager._remote  # served on a new bitmask thread
        assert_pool_idle(llm)
    finally:
        release.set()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.shutdown()


def test_a_gate_forced_at_the_last_constrained_step_emits_nothing_sampled_under_it(monkeypatch):
    # The step after the forced one has no constrained row (no job that could notice the failure): the
    # collect itself aborts the rows (engine_core._collect_inflight), else their last token, sampled
    # under an all-ones bitmask, would be emitted with finish reason "length".
    monkeypatch.setattr(gate_mod, "GATE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(gate_mod, "WATCH_PERIOD_S", 0.05)
    llm = gated_llm("thread", num_gpu_blocks_override=64)
    engine = llm.llm_engine
    release = threading.Event()
    try:
        backend = engine.engine_core.structured_output_manager.backend()
        greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        alone = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
        stuck = {"now": False}
        fill_job = backend.fill_job

        def maybe_stuck(grammars, bitmask, rows=None):
            job = fill_job(grammars, bitmask, rows)
            hang = stuck["now"]  # decided here, in the step loop (the thread may start the job later)

            def run():
                if hang:
                    bitmask.fill_(-1)
                    release.wait()
                job()
            return run

        monkeypatch.setattr(backend, "fill_job", maybe_stuck)
        engine.add_request("free", PROMPTS[0], greedy)
        m = 12
        params = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=m, ignore_eos=True, structured_outputs=REGEX)
                  for i in range(3)]
        for i, p in enumerate(params):
            engine.add_request(f"c{i}", PROMPTS[i + 1], p)
        done, seen = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = len(out.outputs[0].token_ids)
                if out.finished:
                    done[out.request_id] = out
            if len(seen) == 4 and min(seen[f"c{i}"] for i in range(3)) == m - 2:
                # The last request to join has token m - 1 in flight (its job posted): the next job is
                # the gate of its last token (the others, a step ahead if they joined earlier, are done).
                stuck["now"] = True
        reasons = [done[f"c{i}"].outputs[0].finish_reason for i in range(3)]
        assert "abort" in reasons, reasons
        for i, p in enumerate(params):
            out = done[f"c{i}"].outputs[0]
            # Aborted: its last token (under the forced gate) dropped; else all m, under filled gates.
            assert len(out.token_ids) == (m - 1 if out.finish_reason == "abort" else m), (out.finish_reason, out.token_ids)
            assert refused(llm, p.structured_outputs, list(out.token_ids)) is None
        assert done["free"].outputs[0].token_ids == alone
        assert_pool_idle(llm)
    finally:
        release.set()
        engine.shutdown()


def test_flag_words_raise_is_elementwise():
    words = np.zeros(3, dtype=np.int32)
    flags = FlagWords(torch.from_numpy(words), None, fillers=3)
    flags.seq = 5
    words[:] = [6, 2, 4]
    flags.raise_words(flags.words[:3], 5)
    assert words.tolist() == [6, 5, 5]
