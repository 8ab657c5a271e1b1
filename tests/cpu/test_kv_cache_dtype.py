"""kv_cache_dtype: vLLM's flag, the "auto" rule (float16 for GGUF blocks computed on the CPU, the
model dtype otherwise), and a 16-bit cache through every path that holds it (the cache tensors,
their size in blocks, swap space, prefill and decode attention)."""

import argparse
import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.config import CacheConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.kv_cache import kv_cache_bytes_per_block, resolve_kv_cache_dtype
from tests.utils import assert_pool_idle, tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8", "half", "float64"])
def test_unsupported_kv_cache_dtypes_are_refused(name):
    with pytest.raises(ValueError, match="choose one of auto, float16, bfloat16, float32"):
        CacheConfig(cache_dtype=name)


def test_cli_flag_reaches_the_cache_config():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "bfloat16", "--device", "cpu"]))
    assert args.create_engine_config().cache_config.cache_dtype == "bfloat16"
    bad = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8", "--device", "cpu"]))
    with pytest.raises(ValueError, match="fp8"):
        bad.create_engine_config()


def test_auto_is_float16_only_for_gguf_blocks_on_the_cpu(cpu_kernels):
    def resolved(**kw):
        return resolve_kv_cache_dtype(EngineArgs(device="cpu", **kw).create_engine_config())[0]

    assert resolved() == torch.float16  # the embedded SmolLM2 GGUF: blocks computed in place
    assert resolved(kv_cache_dtype="float32") == torch.float32
    assert resolved(kv_cache_dtype="bfloat16") == torch.bfloat16
    assert resolved(load_format="dummy") == torch.float32  # dummy weights are dense: the model dtype
    assert resolved(model=tiny_model("llama3")[0]) == torch.float32  # safetensors: the model dtype
    config = EngineArgs(device="cpu").create_engine_config()
    full = EngineArgs(device="cpu", kv_cache_dtype="float32").create_engine_config()
    assert 2 * kv_cache_bytes_per_block(config) == kv_cache_bytes_per_block(full)


def _prompts(n=6, length=24, seed=3):
    rng = random.Random(seed)
    return [[rng.randrange(512) for _ in range(length)] for _ in range(n)]


def _run(path, kv_cache_dtype, **kw):
    llm = LLM(path, skip_tokenizer_init=True, max_model_len=64, kv_cache_dtype=kv_cache_dtype, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    assert_pool_idle(llm)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_16bit_cache_through_prefill_decode_and_swap(cpu_kernels):
    path = tiny_model("llama3")[0]
    llm, ref = _run(path, "float16", num_gpu_blocks_override=256)
    kv_cache = llm.llm_engine.engine_core.model_executor.driver_worker.kv_cache
    assert kv_cache.dtype == torch.float16 and all(c.dtype == torch.float16 for c in kv_cache.tensors)
    # 4 blocks for 6 requests growing to 44 tokens: preempted, swapped out and back in block for block,
    # so the tokens are those of the run that kept everything.
    llm, out = _run(path, "float16", num_gpu_blocks_override=4, preemption_mode="swap")
    assert all(c.dtype == torch.float16 for c in llm.llm_engine.engine_core.model_executor.driver_worker.swap_space.cpu_caches)
    assert llm.llm_engine.engine_core.scheduler.preemption.num_swapped_out > 0
    assert out == ref
