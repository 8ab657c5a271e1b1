"""InputBatch's persistent block table (a row per request, grown and reused) and the runner's cached
SamplingMetadata: both are host-time shortcuts, so each must give exactly what a fresh build gives."""

from __future__ import annotations

import random

import numpy as np
import torch

from pagedllm import SamplingParams
from pagedllm.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.engine_core import EngineCore
from pagedllm.request import Request
from pagedllm.worker.input_batch import InputBatch
from tests.utils import tiny_model


def test_the_persistent_block_table_matches_a_fresh_one_through_growth_finish_and_reuse():
    rng = random.Random(0)
    bs = 4
    batch = InputBatch(bs, torch.device("cpu"))
    blocks: dict[str, list[int]] = {}  # the reference: every request's block ids
    computed: dict[str, int] = {}
    next_id = 1
    finished: set[str] = set()
    for step in range(40):
        new, cached, sched = [], [], {}
        for rid in list(blocks):
            if rng.random() < 0.15:  # finish (its row must come back zeroed for the next owner)
                del blocks[rid], computed[rid]
                finished.add(rid)
                continue
            extra = [next_id + k for k in range(rng.choice([0, 0, 1, 3]))]  # up to 3 new blocks a step
            next_id += len(extra)
            blocks[rid] += extra
            computed[rid] = min(computed[rid] + 1, len(blocks[rid]) * bs - 1)
            cached.append(CachedRequestData(rid, extra, computed[rid]))
            sched[rid] = 1
        for k in range(rng.choice([0, 1, 4, 9])):  # past 16 rows and 16 blocks: both dimensions grow
            rid = f"s{step}-{k}"
            n = rng.randint(1, 24)
            blocks[rid] = list(range(next_id, next_id + n))
            next_id += n
            computed[rid] = n * bs - 1
            tokens = list(range(computed[rid] + 1))
            new.append(NewRequestData(rid, tokens, 1, tokens[1:], SamplingParams(), list(blocks[rid]), computed[rid]))
            sched[rid] = 1
        so = SchedulerOutput(new, cached, sched, len(sched), finished_req_ids=finished)
        finished = set()
        membership = batch.membership
        batch.update_states(so)
        assert batch.membership == membership + (1 if new or so.finished_req_ids else 0)
        if not sched:
            continue
        # Pending tokens never arrive here: every input token is on the host.
        for c in cached:
            st = batch.requests[c.req_id]
            st.token_ids.extend(range(len(st.token_ids), computed[c.req_id] + 1))
        inp = batch.prepare_inputs(so)
        width = max(len(blocks[r]) for r in sched)
        ref = np.zeros((len(sched), width), dtype=np.int32)
        for i, r in enumerate(sched):
            ref[i, : len(blocks[r])] = blocks[r]
        np.testing.assert_array_equal(inp.block_table, ref)
        pos = np.array([computed[r] for r in sched])
        ref_slots = np.array([blocks[r][p // bs] * bs + p % bs for r, p in zip(sched, pos)])
        np.testing.assert_array_equal(inp.slot_mapping, ref_slots)
    assert batch._table.shape[0] > 16 and batch._table.shape[1] > 16  # both grew


def test_the_sampling_metadata_is_rebuilt_exactly_when_the_batch_changes():
    path, _ = tiny_model("llama3")
    config = EngineArgs(model=path, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=64,
                        device="cpu").create_engine_config()
    core = EngineCore(config)
    runner = core.model_executor.driver_worker.model_runner
    built: list = []
    build = runner._sampling_metadata

    def note(inp, states):
        smd = build(inp, states)
        built.append(smd)
        return smd
    runner._sampling_metadata = note

    def step():
        while True:  # one step that samples
            n = len(built)
            core.step()
            if len(built) > n:
                return built[-1]

    core.add_request(Request("a", [1, 2, 3], SamplingParams(temperature=0.7, seed=1, max_tokens=20, ignore_eos=True)))
    core.add_request(Request("b", [4, 5], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
    first = step()
    assert step() is first and step() is first  # same rows, same states: the cached build
    core.add_request(Request("c", [6, 7, 8], SamplingParams(temperature=0, max_tokens=3, min_tokens=2,
                                                            stop_token_ids=[9], ignore_eos=True)))
    with_c = step()
    assert with_c is not first and with_c.num_reqs == 3
    # A min_tokens row counts down its remaining tokens: a fresh build every step until it is done.
    assert step() is not with_c
    while core.scheduler.requests.get("c") is not None:
        core.step()
    after_c = step()
    assert after_c.num_reqs == 2 and step() is after_c
    core.abort_requests(["a", "b"])
    while core.has_unfinished_requests():
        core.step()
