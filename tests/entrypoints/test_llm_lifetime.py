"""`del llm; gc.collect()` gives the model and the KV cache back, as vLLM users free memory between
engines in one process (notebooks, sweeps). The engine freezes the GC heap at start (frozen objects
are never collected), so this only holds because LLM hands the heap back when it goes away: on CUDA
the model runner and its CUDA-graph runner refer to each other, and that cycle holds the weights and
the KV cache."""

import gc
import weakref

from pagedllm import LLM, SamplingParams
from tests.utils import tiny_model


def test_deleting_the_llm_frees_its_model_and_kv_cache():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    runner = llm.llm_engine.engine_core.model_runner
    model, kv_cache = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    del llm, runner, out
    gc.collect()
    assert gc.get_freeze_count() == 0  # nothing left where the collector cannot see it
    assert model() is None and kv_cache() is None
