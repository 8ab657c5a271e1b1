"""The embedded SmolLM2-135M-Instruct GGUF: greedy tokens equal transformers' own GGUF load (fp32)."""

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.loader import default_model_path
from tests.utils import assert_pool_idle

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=1024, num_gpu_blocks_override=256)


def test_greedy_matches_transformers_gguf(llm):
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    outs = llm.generate(
        [{"prompt_token_ids": i} for i in ids],
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
        use_tqdm=False,
    )
    for i, o in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([i]), max_new_tokens=64, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(i):].tolist()
        assert o.outputs[0].token_ids == ref
    assert_pool_idle(llm)


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"  # the model ends its turn with <|im_end|>
    assert_pool_idle(llm)


def test_fused_decoder_stack_equals_modules(llm):
    """The one-call C decoder stack (cpu/decoder.py) takes the embedded model's steps, and its
    logprobs equal the nn.Module path's bit for bit (same kernels, same order)."""
    model = llm.llm_engine.engine_core.model_executor.driver_worker.model_runner.model.model
    ids = [{"prompt_token_ids": llm.get_tokenizer().encode(q)} for q in QUESTIONS[:2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm.reset_prefix_cache()  # both runs prefill the same tokens
    fused = llm.generate(ids, params, use_tqdm=False)
    stack = model.__dict__["_cpu_decoder_stack"]
    assert stack.ok, "the embedded model's steps must take the fused stack"
    stack.ok = False
    try:
        llm.reset_prefix_cache()
        modules = llm.generate(ids, params, use_tqdm=False)
    finally:
        stack.ok = True
    for a, b in zip(fused, modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert_pool_idle(llm)
