"""Async scheduling (step N+1 prepared before step N's tokens are collected) changes nothing a
user sees: the same tokens, finish reasons and a fully free pool — also under preemption and with
penalties and min_tokens, which force a collection before the step that needs them."""

import random

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle, tiny_model


@pytest.fixture(scope="module")
def path():
    return tiny_model("qwen3")[0]


def run(path, prompts, params, **kw):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=128, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert_pool_idle(llm)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]


def test_async_equals_sync(path):
    rng = random.Random(5)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    params = [
        SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[7, 9, 11, 13]),
        SamplingParams(temperature=0.7, seed=3, max_tokens=25, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0, max_tokens=12, min_tokens=10, stop_token_ids=list(range(100))),
        SamplingParams(temperature=0.8, seed=9, max_tokens=16, logprobs=3, ignore_eos=True),
    ]
    plist = [params[i % len(params)] for i in range(len(prompts))]
    for kw in (dict(num_gpu_blocks_override=256), dict(num_gpu_blocks_override=10, enable_prefix_caching=False),
               dict(num_gpu_blocks_override=256, max_num_batched_tokens=16)):
        _, sync = run(path, prompts, plist, async_scheduling=False, **kw)
        llm, asyn = run(path, prompts, plist, async_scheduling=True, **kw)
        assert asyn == sync, kw
    assert llm.llm_engine.engine_core.async_scheduling
