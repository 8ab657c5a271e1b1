"""The same prompt gives the same greedy tokens alone, in a batch of 32 mixed-length requests, with
chunked prefill forced (max_num_batched_tokens=16), and under preemption in a tiny KV pool."""

import random

import pytest

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama3")


def batch(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 70))] for _ in range(32)]


def run(path, prompts, **kw):
    llm = LLM(path, skip_tokenizer_init=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_pool_idle(llm)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_alone_batched_chunked_preempted_agree(model):
    path, hf = model
    prompts = batch(hf.config.vocab_size)
    _, alone = run(path, prompts[:1], num_gpu_blocks_override=64)
    _, batched = run(path, prompts, num_gpu_blocks_override=512)
    _, chunked = run(path, prompts, num_gpu_blocks_override=512, max_num_batched_tokens=16)
    # 12 blocks of 16 = 192 tokens for 32 requests of up to 94 tokens: constant preemption.
    llm, preempted = run(path, prompts, num_gpu_blocks_override=12, max_model_len=128, enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.scheduler.num_preemptions > 0
    assert batched[0] == alone[0]
    assert chunked == batched
    assert preempted == batched


def test_every_request_preempted_at_least_once(model):
    path, hf = model
    rng = random.Random(2)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(30)] for _ in range(4)]
    _, ref = run(path, prompts, num_gpu_blocks_override=64)
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=5, max_model_len=64, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    # Each request needs 4 of the 5 blocks at its end, so they run one after the other and
    # every one but the last admitted is pushed out by the others' growth.
    reqs_preempted = llm.llm_engine.engine_core.scheduler.num_preemptions
    assert reqs_preempted >= 3
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert_pool_idle(llm)
