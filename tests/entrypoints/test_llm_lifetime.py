"""`del llm; gc.collect()` gives the model and the KV cache back, as vLLM users free memory between
engines in one process (notebooks, sweeps). The engine freezes the GC heap at start (frozen objects
are never collected), so this only holds because LLM hands the heap back when it goes away: each
linear layer and its parameters refer to each other (the parameters' weight_loader is a bound method
of the layer), and on CUDA the worker, its model runner and its CUDA-graph runner do, and those cycles hold the
weights and the KV cache."""

import gc
import weakref

from pagedllm import LLM, SamplingParams
from tests.utils import tiny_model


def test_deleting_the_llm_frees_its_model_and_kv_cache():
    path, _ = tiny_model("llama3")
    llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=128)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    worker = llm.llm_engine.engine_core.model_executor.driver_worker
    qkv_weight = next(p for name, p in worker.model.named_parameters() if "qkv_proj" in name)
    refs = [weakref.ref(x) for x in (worker.model, qkv_weight, worker.kv_cache.tensors[0])]
    del llm, worker, out, qkv_weight
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def test_del_llm_alone_frees_the_engine_as_in_the_seed_loop():
    """Seed §4.3 / §7.1: `del llm; torch.cuda.empty_cache()` then the next LLM(...), with no
    gc.collect() in between: the engine, its model and its KV cache are gone at `del`."""
    path, _ = tiny_model("llama3")
    for _ in range(2):
        llm = LLM(path, skip_tokenizer_init=True, num_gpu_blocks_override=64, max_model_len=128)
        runner = llm.llm_engine.engine_core.model_runner
        refs = [weakref.ref(x) for x in (llm.llm_engine, runner.model, runner.kv_caches[0])]
        del llm, runner
        assert [r() for r in refs] == [None, None, None]
