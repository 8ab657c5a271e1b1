"""Blocks behind a sliding window are freed during a request (core/kv_cache_manager.py), without a
model: a fake runner 'samples' token 7. Held to transformers' tokens in tests/models/test_sliding_window.py."""

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_manager import NULL_BLOCK
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def make(num_blocks, window, budget=16, caching=True, mode="recompute", cpu_blocks=0):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=4096),
                  CacheConfig(block_size=4, enable_prefix_caching=caching), num_blocks, mode, cpu_blocks,
                  sliding_window=window)
    return s


def step(s, peak):
    so = s.schedule()
    s.kv_cache_manager.check_invariants()
    kv = s.kv_cache_manager
    peak[0] = max(peak[0], kv.num_blocks - kv.block_pool.get_num_free_blocks())
    for rid in so.num_scheduled_tokens:
        r = s.requests[rid]
        # Every position the step's queries read (keys r.num_computed_tokens - n - W + 1 ..) is a real block.
        ids = kv.get_block_ids(rid, skipped_id=-1)
        first = max(r.num_computed_tokens - so.num_scheduled_tokens[rid] - kv.sliding_window + 1, 0) // 4
        assert all(i >= 0 for i in ids[first:]), (rid, first, ids)
    ids = list(so.num_scheduled_tokens)
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[7] * len(ids)))
    return so


def run(s, limit=2000):
    peak = [0]
    for _ in range(limit):
        if not s.has_unfinished_requests():
            break
        step(s, peak)
    assert not s.has_unfinished_requests()
    return peak[0]


def test_a_context_many_windows_long_runs_in_a_pool_of_a_few_windows():
    # 600 tokens = 150 blocks of 4 in a 12-block pool: window 10 + a 16-token chunk holds <= 8 blocks.
    s = make(num_blocks=12, window=10)
    assert s.max_blocks_held(600) == 8
    s.add_request(Request("a", list(range(1, 501)), SamplingParams(max_tokens=100, ignore_eos=True)))
    assert run(s) <= 8
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 12
    # Without freeing the same request can never fit: refused at once.
    full = make(num_blocks=12, window=None)
    with pytest.raises(ValueError, match="could never be scheduled"):
        full.add_request(Request("a", list(range(1, 501)), SamplingParams(max_tokens=100)))


def test_windowed_prefix_hit_needs_only_the_last_window():
    s = make(num_blocks=40, window=10)
    prompt = list(range(1, 201))
    s.add_request(Request("a", prompt, SamplingParams(max_tokens=1)))
    run(s)
    kv = s.kv_cache_manager
    b = Request("b", prompt + [9, 9], SamplingParams(max_tokens=1))
    hits, num_hit = kv.get_computed_blocks(b)
    # 202 tokens -> at most 50 full blocks hit; the query at 200 reads keys 191.., blocks 47..49.
    assert num_hit == 200 and len(hits) == 50
    assert hits[:47] == [NULL_BLOCK] * 47 and all(h is not NULL_BLOCK for h in hits[47:])
    s.add_request(b)
    so = s.schedule()
    assert so.num_scheduled_tokens["b"] == 2
    assert so.scheduled_new_reqs[0].block_ids[:47] == [0] * 47  # the worker reads block 0 there
    assert kv.num_blocks_held("b") == 4
    kv.check_invariants()


def test_swap_preemption_keeps_only_the_window():
    # Two requests that each fit alone; together they preempt (swap): only real blocks are copied.
    s = make(num_blocks=5, window=8, budget=8, mode="swap", cpu_blocks=20)
    for rid in "ab":
        s.add_request(Request(rid, list(range(1, 61)), SamplingParams(max_tokens=40, ignore_eos=True)))
    copies = []
    peak = [0]
    for _ in range(500):
        if not s.has_unfinished_requests():
            break
        so = step(s, peak)
        copies += so.blocks_to_swap_out + so.blocks_to_swap_in
        s.preemption.check_invariants()
    assert not s.has_unfinished_requests() and s.num_preemptions > 0
    assert copies and all(g >= 0 and c >= 0 for g, c in copies)
    assert len(s.preemption.free_cpu_blocks) == 20
