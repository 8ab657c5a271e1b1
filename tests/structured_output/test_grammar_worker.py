"""The grammar worker process (structured_output/backend_process.py, grammar_worker.py) against the
bitmask thread's in-process backend: the same bitmasks step by step for the same tokens, refused
tokens reported, finished / aborted / never-compiled requests dropped in the worker, the process
gone and its shared memory unlinked at shutdown, a dead worker a clear error; and in the engine,
greedy outputs of constrained and unconstrained rows in one batch equal to the thread path's."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.backend_process import ProcessGrammar
from pagedllm.structured_output.manager import StructuredOutputManager, make_backend
from tests.structured_output.schemas import PERSON_SCHEMA as SCHEMA

DOC = '{"name": "Ann", "age": 42}'
VOCAB = 49152


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pagedllm.loader import default_model_path

    folder = os.environ.get("PAGEDLLM_TEST_TOKENIZER")  # a tokenizer folder (the GPU machine has no GGUF)
    if folder:
        return AutoTokenizer.from_pretrained(folder)
    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def manager_with(backend, rows: int = 4) -> StructuredOutputManager:
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=rows),
                             device_config=SimpleNamespace(device="cpu"))
    manager = StructuredOutputManager(config)
    manager._backend = backend
    manager._remote = getattr(backend, "remote", False)
    return manager


def add(manager, rid: str, so: StructuredOutputsParams | None = None):
    params = SamplingParams(structured_outputs=so or StructuredOutputsParams(json=SCHEMA))
    return manager.add_request(SimpleNamespace(request_id=rid, sampling_params=params))


def step(*rids: str):
    return SimpleNamespace(num_scheduled_tokens=dict.fromkeys(rids, 1), sampling_req_ids=set(rids))


@pytest.fixture(scope="module")
def worker_backend(tokenizer):
    backend = make_backend(tokenizer, VOCAB, worker=True, rows=4)
    assert backend.remote
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def two_workers(tokenizer):
    backend = make_backend(tokenizer, VOCAB, worker=True, rows=4, num_workers=2)
    assert backend.remote and len(backend._lanes) == 2
    yield backend
    backend.shutdown()


@pytest.mark.parametrize("workers", ["one worker", "two workers"])
def test_the_worker_fills_the_same_bitmasks_as_the_thread_path(tokenizer, worker_backend, two_workers, workers):
    doc = tokenizer.encode(DOC, add_special_tokens=False)
    local = manager_with(make_backend(tokenizer, VOCAB))
    remote = manager_with(worker_backend if workers == "one worker" else two_workers)
    for m in (local, remote):
        for rid in ("a", "b", "c"):
            add(m, rid).future.result()
    for j in range(len(doc) + 1):
        if j:  # "a" follows the document; "b" and "c" stop after two tokens (their rows then stay free)
            outs = [EngineCoreOutput("a", [doc[j - 1]])]
            outs += [EngineCoreOutput(r, [doc[j - 1]]) for r in ("b", "c") if j <= 2]
            local.advance(outs)
            remote.advance(outs)
        so = step("c", "a", "b") if j <= 2 else step("a")
        want = local.submit_grammar_bitmask(so).result()
        got = remote.submit_grammar_bitmask(so).result()
        assert got.structured_output_request_ids == want.structured_output_request_ids
        assert torch.equal(got.grammar_bitmask, want.grammar_bitmask), f"step {j}"
    # The document is complete: EOS (the stop token) is now allowed, and ends the grammar.
    eos = tokenizer.eos_token_id
    assert (got.grammar_bitmask[0, eos // 32] >> (eos % 32)) & 1
    remote.advance([EngineCoreOutput("a", [eos])])
    assert remote.submit_grammar_bitmask(step("a")).result() is None  # the job's accept ends it: no row
    assert remote.requests["a"].ended
    local.shutdown()


def test_finished_aborted_and_compiling_requests_leave_the_worker(worker_backend):
    manager = manager_with(worker_backend)
    before = worker_backend.stats.get("live", 0)
    for rid in ("x", "y", "z"):
        add(manager, rid).future.result()
    manager.submit_grammar_bitmask(step("x", "y", "z")).result()
    assert worker_backend.stats["live"] == before + 3
    manager.advance([EngineCoreOutput("x", [123], finish_reason="length")])  # finished by the scheduler
    manager.remove(["y"])  # aborted mid-grammar
    manager.submit_grammar_bitmask(step("z")).result()
    assert worker_backend.stats["live"] == before + 1
    sor = add(manager, "w", StructuredOutputsParams(regex="[a-z]{3,9}"))
    manager.remove(["w", "z"])  # aborted while (possibly) still compiling
    sor.future.result()
    assert manager.submit_grammar_bitmask(step()).result() is None  # no row: no job was sent
    add(manager, "v").future.result()
    manager.submit_grammar_bitmask(step("v")).result()
    assert worker_backend.stats["live"] == before + 1  # only "v"
    manager.remove(["v"])


def test_a_bad_grammar_fails_in_the_engine_and_its_slot_is_dropped(worker_backend):
    with pytest.raises(ValueError, match="parenthesis"):
        worker_backend.validate(StructuredOutputsParams(regex="(abc"))
    with pytest.raises(ValueError, match="parenthesis"):
        worker_backend.compile_grammar(StructuredOutputsParams(regex="(abc"), [2])
    assert worker_backend._lanes[0].removed  # sent with the next job


def test_a_refused_token_is_reported(worker_backend, caplog):
    manager = manager_with(worker_backend)
    add(manager, "r", StructuredOutputsParams(regex="[0-9]{3}")).future.result()
    manager.submit_grammar_bitmask(step("r")).result()
    manager.advance([EngineCoreOutput("r", [ord("a") % 100 + 1000])])  # not a digit token
    with caplog.at_level(logging.ERROR, logger="pagedllm.structured_output.worker_lanes"):
        manager.submit_grammar_bitmask(step("r")).result()
    assert "refused" in caplog.text
    # The reply's slot is mapped to its request at the next job; the engine core ends it (an error).
    manager.submit_grammar_bitmask(step("r")).result()
    assert manager.take_refused() == ["r"] and manager.take_refused() == []
    manager.remove(["r"])


def test_shutdown_ends_the_worker_and_unlinks_its_memory_and_a_dead_worker_is_an_error(tokenizer):
    backend = make_backend(tokenizer, VOCAB, worker=True, rows=2)
    manager = manager_with(backend, rows=2)
    add(manager, "a").future.result()
    manager.submit_grammar_bitmask(step("a")).result()
    proc, name = backend._workers.procs[0], backend._workers.shm.name
    assert os.path.exists("/dev/shm/" + name)
    proc.kill()
    proc.wait()
    manager.advance([EngineCoreOutput("a", [tokenizer.encode("{", add_special_tokens=False)[0]])])
    with pytest.raises(RuntimeError, match="grammar worker"):
        manager.submit_grammar_bitmask(step("a")).result()
    manager.shutdown()
    assert not os.path.exists("/dev/shm/" + name)

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=2)
    proc, name = backend._workers.procs[0], backend._workers.shm.name
    manager_with(backend, rows=2).shutdown()
    assert proc.poll() is not None and not os.path.exists("/dev/shm/" + name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_shared_buffers_are_pinned_and_copy_exactly(tokenizer):
    from pagedllm.host_copy import to_device_async

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=4, pin_memory=True)
    assert backend.remote, "the grammar worker did not start"
    try:
        local = manager_with(make_backend(tokenizer, VOCAB))
        remote = manager_with(backend)
        for m in (local, remote):
            add(m, "a").future.result()
        want = local.submit_grammar_bitmask(step("a")).result().grammar_bitmask
        got = remote.submit_grammar_bitmask(step("a")).result().grammar_bitmask
        assert got.is_pinned()
        on_device = to_device_async(got, torch.device("cuda"))
        torch.cuda.synchronize()
        assert torch.equal(on_device.cpu(), want)
        local.shutdown()
    finally:
        backend.shutdown()


def test_engine_outputs_equal_the_thread_path(monkeypatch):
    from pagedllm import LLM
    from tests.utils import assert_pool_idle

    questions = ["Describe a person.", "What is the capital of France?", "Name a color."]

    def run(worker: str):
        monkeypatch.setenv("PAGEDLLM_GRAMMAR_WORKER", worker)
        llm = LLM(max_model_len=512, num_gpu_blocks_override=128, async_scheduling=True)
        tok = llm.get_tokenizer()
        prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
        params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=SCHEMA)),
                  SamplingParams(temperature=0, max_tokens=16),
                  SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"))]
        outs = llm.generate(prompts, params, use_tqdm=False)
        manager = llm.llm_engine.engine_core.structured_output_manager
        assert manager._remote == (worker == "1")
        assert_pool_idle(llm)
        proc = manager.backend()._workers.procs[0] if manager._remote else None
        name = manager.backend()._workers.shm.name if manager._remote else None
        llm.llm_engine.shutdown()
        if proc is not None:  # the engine's shutdown ends the worker and unlinks its memory
            assert proc.poll() is not None and not os.path.exists("/dev/shm/" + name)
        return [o.outputs[0].token_ids for o in outs]

    assert run("1") == run("0")


def test_gated_jobs_fill_the_thread_paths_bitmasks_and_set_every_workers_flag(tokenizer, two_workers):
    # Gated sampling (gate.py): the job goes out after the launch; each worker fills its rows, then
    # sets its own flag word, and the gate opens only once both have.
    from pagedllm.structured_output.gate import host_wait

    manager, ref = manager_with(two_workers, rows=2), manager_with(make_backend(tokenizer, VOCAB), rows=2)
    try:
        for m in (manager, ref):
            add(m, "g1").future.result()
            add(m, "g2").future.result()
        for t in tokenizer.encode(DOC, add_special_tokens=False)[:6]:
            gate = manager.gate_step(step("g1", "g2"))
            assert gate.request_ids == ["g1", "g2"] and len(gate.flags) == 2 and not gate.is_open()
            manager.submit_gate(gate)
            host_wait(gate, timeout_s=30)
            assert torch.equal(gate.bitmask, ref.grammar_bitmask(step("g1", "g2")).grammar_bitmask)
            for m in (manager, ref):
                m.advance([EngineCoreOutput("g1", [t]), EngineCoreOutput("g2", [t])])
        # Hundreds of gated steps (a JSON array of numbers, one token each): nothing piles up in the
        # sockets (an unread message a step would block the workers within a few hundred), and the
        # workers counted every job.
        two_workers.gated_stats()
        arr = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})
        for m in (manager, ref):
            add(m, "n1", arr).future.result()
            add(m, "n2", arr).future.result()
        digits = [tokenizer.encode(t, add_special_tokens=False)[0] for t in ("[", "1", ",")]
        for i in range(600):
            gate = manager.gate_step(step("n1", "n2"))
            manager.submit_gate(gate)
            host_wait(gate, timeout_s=30)
            t = digits[0] if i == 0 else digits[1] if i % 2 else digits[2]  # [ 1 , 1 , 1 ...
            assert all((int(gate.bitmask[r, t >> 5]) >> (t & 31)) & 1 for r in (0, 1))  # both rows allow it
            manager.advance([EngineCoreOutput("n1", [t]), EngineCoreOutput("n2", [t])])
        manager._wait_gate_job()
        assert two_workers.gated_stats()["jobs"] == 600
        manager.remove(["n1", "n2"])
        manager.remove(["g2"])  # finished between the launch and the job: its row is all ones
        gate = manager.gate_step(step("g1"))
        manager.submit_gate(gate)
        host_wait(gate, timeout_s=30)
        assert torch.equal(gate.bitmask, ref.grammar_bitmask(step("g1")).grammar_bitmask)
        # A gated job gets no reply: a worker's failure (here a slot it never had) still raises its
        # flag, and the next job raises.
        manager._wait_gate_job()
        gate = manager.gate_step(step("g1"))
        stranger = ProcessGrammar(1001, frozenset(), two_workers._lanes[1])
        manager._gate_job, _ = two_workers.gate_job([stranger], gate.bitmask, [0], gate.seq)
        host_wait(gate, timeout_s=30)
        with pytest.raises(RuntimeError, match=r"grammar worker\(s\) \[1\] failed a gated step"):
            manager._wait_gate_job()
    finally:
        manager.remove(["g1", "g2"])
        manager._wait_gate_job()
        ref.shutdown()


def test_a_dead_worker_opens_a_waiting_gate(tokenizer):
    # A gate the device waits on must not stay shut when its worker dies: the watchdog opens it
    # (and the next job raises, as for any dead worker).
    from pagedllm.structured_output.gate import host_wait

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=2)
    manager = manager_with(backend, rows=2)
    try:
        add(manager, "a").future.result()
        gate = manager.gate_step(step("a"))
        assert not gate.is_open()
        backend._workers.procs[0].kill()
        host_wait(gate, timeout_s=10)
        with pytest.raises(RuntimeError, match="grammar worker"):
            manager.submit_gate(gate)
    finally:
        manager.shutdown()


def test_gated_jobs_through_the_job_area_fill_the_same_bitmasks(tokenizer):
    # PAGEDLLM_GRAMMAR_SPIN (grammar_worker.py's job channel): after a gated job the workers poll
    # their shared-memory areas, and the next jobs go there instead of the socket; after a pause
    # (the workers stopped polling) a job goes on the socket again. Same bitmasks as the thread
    # path, every step, through both channels, and an add on the socket reaches the worker before
    # an area job fills its slot.
    from pagedllm.structured_output.gate import host_wait

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=4, num_workers=2, spin=True)
    manager, ref = manager_with(backend, rows=4), manager_with(make_backend(tokenizer, VOCAB), rows=4)
    try:
        for m in (manager, ref):
            add(m, "g1").future.result()
            add(m, "g2").future.result()
        backend.gated_stats()
        doc = tokenizer.encode(DOC, add_special_tokens=False)
        rids = ["g1", "g2"]
        for i, t in enumerate(doc):
            if i == 3:  # a new request joins between two area jobs (its "add" on the socket)
                for m in (manager, ref):
                    add(m, "g3").future.result()
                rids = ["g1", "g2", "g3"]
            if i == 6:
                time.sleep(0.15)  # longer than SPIN_S: the workers went back to the socket
            gate = manager.gate_step(step(*rids))
            assert len(gate.flags) == 1  # the combined word: the device waits once for both workers
            manager.submit_gate(gate)
            host_wait(gate, timeout_s=30)
            assert (backend.flags.numpy() >= gate.seq).all()  # raised only once both workers' words were
            assert torch.equal(gate.bitmask, ref.grammar_bitmask(step(*rids)).grammar_bitmask), i
            for m in (manager, ref):
                m.advance([EngineCoreOutput(r, [t]) for r in rids])
        manager.remove(["g2"])  # its slot goes to the workers in the next area job's removed list
        gate = manager.gate_step(step("g1", "g3"))
        manager.submit_gate(gate)
        host_wait(gate, timeout_s=30)
        assert torch.equal(gate.bitmask, ref.grammar_bitmask(step("g1", "g3")).grammar_bitmask)
        manager._wait_gate_job()
        stats = backend.gated_stats()
        assert stats["jobs"] == len(doc) + 1
        assert 0 < stats["area_jobs"] <= len(doc) - 1  # the first job and the one after the pause: the socket
    finally:
        manager.shutdown()
        ref.shutdown()


def test_a_job_written_as_the_workers_stop_polling_runs_after_the_watchdogs_poke(tokenizer):
    # The engine writes a job into an area only while the worker's deadline is SPIN_MARGIN_S ahead;
    # should it lose that race (a long GIL stall between the look and the write), the job still runs:
    # the watchdog pokes the workers of a gate that stays shut. Forced here by moving the deadline
    # the engine reads far ahead while the worker waits on its socket.
    from pagedllm.structured_output.backend_process import WATCHDOG_PERIOD_S
    from pagedllm.structured_output.gate import host_wait

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=2, spin=True)
    manager, ref = manager_with(backend, rows=2), manager_with(make_backend(tokenizer, VOCAB), rows=2)
    try:
        for m in (manager, ref):
            add(m, "a").future.result()
        gate = manager.gate_step(step("a"))
        backend._lanes[0].area[2][0] = time.monotonic() + 3600  # the engine now believes the worker polls
        t = time.monotonic()
        manager.submit_gate(gate)
        host_wait(gate, timeout_s=30)
        assert time.monotonic() - t >= WATCHDOG_PERIOD_S * 0.9  # it waited for the poke
        assert torch.equal(gate.bitmask, ref.grammar_bitmask(step("a")).grammar_bitmask)
        manager._wait_gate_job()
        assert backend.gated_stats()["area_jobs"] == 1
    finally:
        manager.shutdown()
        ref.shutdown()


def test_worker_zero_raises_the_combined_word_only_after_every_workers_word():
    import numpy as np

    from pagedllm.structured_output.grammar_worker import COMBINED_WORD, combine_flags

    words = np.zeros(16, dtype=np.int32)
    view = memoryview(words).cast("B").cast("i")
    words[0] = 5  # worker 0's own word
    words[1] = 4  # worker 1 still on the step before
    later = threading.Timer(0.05, lambda: words.__setitem__(1, 5))
    t = time.monotonic()
    later.start()
    assert combine_flags(view, 2, 5)
    assert time.monotonic() - t >= 0.04 and words[COMBINED_WORD] == 5
    # Raised by someone else meanwhile (the watchdog): it returns, leaving it.
    words[COMBINED_WORD] = 6
    assert not combine_flags(view, 3, 6) and words[COMBINED_WORD] == 6
    # A worker that never comes: it gives up after the timeout, the word left shut.
    assert not combine_flags(view, 2, 7, timeout_s=0.05) and words[COMBINED_WORD] == 6


def test_a_dead_worker_whose_area_still_takes_jobs_opens_every_gate_until_the_next_job_raises(tokenizer):
    # With the job areas a job written for a dead worker raises nothing by itself (no socket write):
    # the watchdog must open every gate issued after the death, not just the one waiting then, until
    # the engine's next job raises. The dead worker's deadline is moved far ahead here, so that the
    # engine keeps writing jobs into its area.
    from pagedllm.structured_output.gate import host_wait

    backend = make_backend(tokenizer, VOCAB, worker=True, rows=2, num_workers=2, spin=True)
    manager = manager_with(backend, rows=2)
    try:
        add(manager, "a").future.result()
        add(manager, "b").future.result()
        doc = tokenizer.encode(DOC, add_special_tokens=False)
        for t in doc[:3]:
            gate = manager.gate_step(step("a", "b"))
            manager.submit_gate(gate)
            host_wait(gate, timeout_s=30)
            manager.advance([EngineCoreOutput("a", [t]), EngineCoreOutput("b", [t])])
        proc = backend._workers.procs[1]
        proc.kill()
        proc.wait()
        backend._lanes[1].area[2][0] = time.monotonic() + 3600
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="grammar worker exited"):
            for t in doc[3:] * 20:
                gate = manager.gate_step(step("a", "b"))
                manager.submit_gate(gate)
                host_wait(gate, timeout_s=10)  # opened by the watchdog: never a hang
                manager.advance([EngineCoreOutput("a", [t]), EngineCoreOutput("b", [t])])
        assert time.monotonic() - t0 < 10
    finally:
        manager.shutdown()
