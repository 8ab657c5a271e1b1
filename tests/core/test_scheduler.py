"""Scheduler behaviour without a model: fake a runner that 'samples' token 7 for every request."""

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def make(num_blocks=64, budget=64, max_seqs=8, max_len=256, block_size=4, caching=False):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len),
        CacheConfig(block_size=block_size, enable_prefix_caching=caching),
        num_blocks,
    )


def req(rid, n_prompt, max_tokens=4, **kw):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, **kw))


def run_step(s):
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[7] * len(ids)))
    return so, outs


def drain(s, limit=1000):
    finished = {}
    for _ in range(limit):
        if not s.has_unfinished_requests():
            break
        _, outs = run_step(s)
        for o in outs:
            if o.finished:
                finished[o.request_id] = o
    return finished


def test_chunked_prefill_spreads_a_long_prompt():
    s = make(budget=16)
    s.add_request(req("a", 40, max_tokens=2))
    chunks = [run_step(s)[0].num_scheduled_tokens["a"] for _ in range(3)]
    assert chunks == [16, 16, 8]
    assert s.requests["a"].num_output_tokens == 1  # sampled only after the last chunk
    drain(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_running_first_and_budget_shared():
    s = make(budget=10)
    s.add_request(req("a", 6))
    run_step(s)
    s.add_request(req("b", 20))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 9}


def test_max_num_seqs():
    s = make(max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4))
    so, _ = run_step(s)
    assert set(so.num_scheduled_tokens) == {"0", "1"}


def test_preemption_recomputes_newest_and_frees_everything():
    # 6 blocks of 4 tokens; two requests each growing to 12 tokens (3 blocks) + more -> pressure.
    s = make(num_blocks=6, budget=64, block_size=4)
    s.add_request(req("old", 8, max_tokens=8))
    s.add_request(req("new", 8, max_tokens=8))
    finished = drain(s)
    assert set(finished) == {"old", "new"}
    assert all(o.finish_reason == "length" for o in finished.values())
    assert s.num_preemptions >= 1
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 6


def test_max_model_len_and_never_fits_rejected_at_admission():
    s = make(num_blocks=4, block_size=4, max_len=64)
    with pytest.raises(ValueError, match="maximum context length is 64"):
        s.add_request(req("a", 60, max_tokens=10))
    with pytest.raises(ValueError, match="could never be scheduled"):
        s.add_request(req("b", 10, max_tokens=10))
    assert not s.has_unfinished_requests()


def test_stop_token_respects_min_tokens():
    s = make()
    p = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=[7])
    p.all_stop_token_ids = {7}
    s.add_request(Request("a", [1, 2, 3], p))
    finished = drain(s)
    assert finished["a"].finish_reason == "stop" and finished["a"].stop_reason == 7
    # the token stream was 7, 7, 7: only the third may stop
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_abort_anywhere_frees_blocks():
    s = make(budget=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 4))
    run_step(s)  # a mid-prefill, b waiting
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64
    so = s.schedule()
    assert so.finished_req_ids == {"a"}  # the runner saw a, never b


def test_prefix_cache_hit_computes_only_the_tail():
    s = make(caching=True, block_size=4)
    s.add_request(req("a", 17, max_tokens=1))
    drain(s)
    s.add_request(req("b", 17, max_tokens=1))
    so = s.schedule()
    assert so.num_scheduled_tokens["b"] == 1  # 16 tokens from 4 cached blocks
    assert s.requests["b"].num_cached_tokens == 16


def test_without_chunked_prefill_a_prompt_runs_whole():
    # Budget 40 (>= max_model_len, as SchedulerConfig requires without chunking): b (30 tokens)
    # does not fit beside a's 20-token prompt, so it waits a step instead of being split; c (10)
    # then does not fit beside b and a's decode (31 + 10 > 40).
    s = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False),
        CacheConfig(block_size=4, enable_prefix_caching=False),
        64,
    )
    s.add_request(req("a", 20, max_tokens=3))
    s.add_request(req("b", 30, max_tokens=3))
    s.add_request(req("c", 10, max_tokens=3))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 20}  # c waits behind b: first come, first served
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 30}
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 1, "c": 10}
    drain(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == 64


def test_without_chunked_prefill_the_budget_must_hold_a_whole_prompt():
    with pytest.raises(ValueError, match="without chunked prefill max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=40, enable_chunked_prefill=False)


def test_pipeline_parallel_batches_are_disjoint_and_carry_the_sampled_tokens():
    """PP 2 (the engine core's batch queue): each batch holds half the requests, a request whose
    token is in flight is left out (a mid-prefill one is not), and the next batch that schedules it
    carries its sampled token to every stage (new_token_ids)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24, max_model_len=256),
                  CacheConfig(block_size=4), 64, pipeline_parallel_size=2)
    for rid in "abcd":
        s.add_request(req(rid, 3, max_tokens=4))
    s.add_request(req("long", 40, max_tokens=2))
    b1 = s.schedule()
    b2 = s.schedule()
    assert list(b1.num_scheduled_tokens) == ["a", "b", "c"]  # ceil(5 / 2) seats
    assert list(b2.num_scheduled_tokens) == ["d", "long"]
    assert b2.num_scheduled_tokens["long"] == 21 and "long" not in b2.sampling_req_ids  # a chunk
    b3 = s.schedule()  # a-d in flight; long's next chunk runs behind its first one
    assert b3.num_scheduled_tokens == {"long": 19} and b3.sampling_req_ids == {"long"}
    s.update_from_output(b1, ModelRunnerOutput(req_ids=["a", "b", "c"], sampled_token_ids=[7, 8, 9]))
    b4 = s.schedule()
    assert {c.req_id: c.new_token_ids for c in b4.scheduled_cached_reqs} == {"a": [7], "b": [8], "c": [9]}
    s.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    empty = s.schedule()  # d gone, long and a-c in flight: nothing to run
    assert empty.is_empty
    assert "d" in s.schedule().finished_req_ids  # kept for the first step that runs, not lost
