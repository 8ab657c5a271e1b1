"""Issue 5: prefix caching, shared blocks for n > 1, swap preemption — nothing lost under KV pressure."""

import random

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture(scope="module")
def path():
    return tiny_model("llama3")[0]


def prompts(n=10, length=24, seed=3):
    """n prompts of `length` tokens; the odd ones share a 16-token prefix (a full block: prefix hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(512) for _ in range(16)]
    return [((shared if i % 2 else []) + [rng.randrange(512) for _ in range(length)])[:length] for i in range(n)]


def run(path, ps, params=GREEDY, **kw):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=80, **kw)
    sched = llm.llm_engine.engine_core.scheduler
    sched.preempted_ids = set()
    preempt = sched._preempt

    def recording_preempt(req):  # which requests were preempted, not only how often
        sched.preempted_ids.add(req.request_id)
        preempt(req)

    sched._preempt = recording_preempt
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert_pool_idle(llm)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_greedy_identical_with_and_without_caching_swap_and_recompute(path):
    ps = prompts()
    _, ref = run(path, ps, num_gpu_blocks_override=256, enable_prefix_caching=False)
    _, cached = run(path, ps, num_gpu_blocks_override=256)
    # 5 blocks of 16 tokens; 10 requests each growing from 24 to 54 tokens (2 -> 4 blocks): every request but the first
    # (the oldest running request is never the victim) is preempted at least once.
    for mode in ("recompute", "swap"):
        for caching in (False, True):
            llm, out = run(path, ps, num_gpu_blocks_override=5, preemption_mode=mode, enable_prefix_caching=caching)
            sched = llm.llm_engine.engine_core.scheduler
            assert len(sched.preempted_ids) >= len(ps) - 1, (mode, caching, sorted(sched.preempted_ids))
            if mode == "swap":
                assert sched.preemption.num_swapped_out >= len(ps) - 1
                sched.preemption.check_invariants()
                assert len(sched.preemption.free_cpu_blocks) == sched.preemption.num_cpu_blocks
            assert out == ref, (mode, caching)
    assert cached == ref


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_too_small(path):
    ps = prompts(8)
    _, ref = run(path, ps, num_gpu_blocks_override=256)
    # swap_space so small it holds one block (16 tokens x 2 layers x 2 x 2 heads x 16 dims x 4 B = 8 KiB)
    llm, out = run(path, ps, num_gpu_blocks_override=5, preemption_mode="swap", swap_space=8 / (1 << 20))
    sched = llm.llm_engine.engine_core.scheduler
    assert sched.preemption.num_cpu_blocks == 1
    assert sched.num_preemptions > sched.preemption.num_swapped_out  # the rest recomputed
    assert out == ref


def test_second_identical_request_computes_only_the_last_block(path):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64)
    prompt = {"prompt_token_ids": list(range(1, 101))}  # 100 tokens = 6 full blocks + 4
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
    hits_before = kv.prefix_cache_hits
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 96  # 6 blocks of 16: only the last partial block is computed
    assert kv.prefix_cache_hits - hits_before == 96
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_idle(llm)
    assert llm.reset_prefix_cache()  # vLLM's LLM.reset_prefix_cache: the next run computes it all
    third = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert third.num_cached_tokens == 0
    assert third.outputs[0].token_ids == first.outputs[0].token_ids


def test_n4_shares_the_prompt_blocks(path):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=1024, num_gpu_blocks_override=512,
              max_num_batched_tokens=2048)
    eng = llm.llm_engine
    prompt = list(range(1, 501))  # 500 tokens = 31 full blocks + 4 tokens
    eng.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=4))
    eng.step()  # all four children prefill in this one step
    kv = eng.engine_core.scheduler.kv_cache_manager
    used = kv.num_blocks - kv.block_pool.get_num_free_blocks()
    # The first child holds 32 blocks; the other three share its 31 full blocks and own one tail each.
    assert used == 32 + 3, used
    shared = [b for b in kv.block_pool.blocks if b.ref_cnt == 4]
    assert len(shared) == 31
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_idle(llm)
