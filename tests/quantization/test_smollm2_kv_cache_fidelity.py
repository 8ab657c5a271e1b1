"""The embedded SmolLM2 GGUF on the CPU keeps its KV cache in float16 by default ("auto"). The issue's
rule for quantized compute: greedy tokens may first differ from the float32 ones no earlier than token
32. Checked here on MIN_AGREEMENT tokens (the bound: a divergence before it fails, one after it is allowed, so
more tokens would prove nothing more) against the float32-cache run, which equals transformers' float32 greedy
tokens on these prompts (tests/engine/test_smollm2_gguf.py checks three of them against transformers directly;
docs/CPU_PROFILE.md records all eight: the float16 cache is identical to transformers for 128 tokens)."""

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.cpu.build import load_cpu_kernels

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
             "Explain photosynthesis in two sentences.", "Write a Python function that reverses a string.",
             "What are the benefits of regular exercise?", "Tell me a short story about a dragon.",
             "How do I make a cup of tea?"]
MIN_AGREEMENT = 32  # the bound for quantized compute


def greedy_tokens(kv_cache_dtype: str) -> tuple[str, list[list[int]]]:
    llm = LLM(max_model_len=512, num_gpu_blocks_override=96, kv_cache_dtype=kv_cache_dtype)
    tok = llm.get_tokenizer()
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
           for q in QUESTIONS]
    outs = llm.generate([{"prompt_token_ids": i} for i in ids],
                        SamplingParams(temperature=0, max_tokens=MIN_AGREEMENT, ignore_eos=True), use_tqdm=False)
    resolved = str(llm.llm_engine.engine_core.model_executor.driver_worker.kv_cache.dtype)
    return resolved, [o.outputs[0].token_ids for o in outs]


def test_float16_cache_follows_float32_for_at_least_32_tokens():
    if load_cpu_kernels() is None:
        pytest.skip("no C compiler: GGUF weights run dense and the cache stays float32")
    dtype, half = greedy_tokens("auto")
    assert dtype == "torch.float16"
    _, full = greedy_tokens("float32")
    for q, a, b in zip(QUESTIONS, half, full):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        assert first >= MIN_AGREEMENT, f"{q!r}: float16 KV cache diverges at token {first}"
