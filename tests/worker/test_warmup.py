"""The start-up warm-up steps run the real model, sampler and attention path and touch no KV slot."""

from __future__ import annotations

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.worker import warmup
from tests.utils import tiny_model


def test_dummy_steps_write_no_kv_and_leave_results_unchanged():
    path, _ = tiny_model("qwen3")
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=256, num_gpu_blocks_override=64, seed=0)
    worker = llm.llm_engine.engine_core.model_executor.driver_worker
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.generate([{"prompt_token_ids": list(range(40))}], params, use_tqdm=False)[0]
    # The cache now holds the prompt's K/V (and its blocks are in the prefix cache).
    snapshot = [c.clone() for c in worker.kv_cache.tensors]
    bs = worker.kv_cache.block_size
    shape = warmup.WarmupShape(block_size=bs, max_model_len=256, max_num_batched_tokens=256, vocab_size=512,
                               hidden_size=64)
    sampler, device = worker.model_runner.sampler, worker.device
    with torch.inference_mode():
        warmup._dummy_step(worker.model, sampler, device, shape, [2 * bs + 3, 1], [2 * bs + 3, 2 * bs + 5])
        warmup._dummy_step(worker.model, sampler, device, shape, [1, 1], [1, bs + 1])
        warmup._dummy_step(worker.model, sampler, device, shape, [1], [256])
    assert all(torch.equal(a, b) for a, b in zip(snapshot, worker.kv_cache.tensors))
    after = llm.generate([{"prompt_token_ids": list(range(40))}], params, use_tqdm=False)[0]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids


def test_warmup_is_a_no_op_without_cuda():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=128, num_gpu_blocks_override=16)
    worker = llm.llm_engine.engine_core.model_executor.driver_worker
    calls = []
    orig = worker.model.forward
    worker.model.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    shape = warmup.WarmupShape(block_size=16, max_model_len=128, max_num_batched_tokens=128, vocab_size=512,
                               hidden_size=64)
    warmup.warmup_kernels(worker.model, worker.model_runner.sampler, worker.device, torch.float32, shape)
    assert calls == []
