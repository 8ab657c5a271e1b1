"""End-to-end check for a model family: a tiny random HF checkpoint saved to disk, served by `LLM`
(chunked prefill, prefix caching, 4-token blocks), greedy fp32 tokens equal to transformers'.

The prompts are mixed: different lengths, two that share a 12-token prefix, and a second call whose
prompts extend the first call's (their leading blocks come from the prefix cache). With
max_num_batched_tokens 16 every prompt longer than that is prefilled in chunks.
"""

from __future__ import annotations

import random
import shutil
import tempfile

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from pagedllm import LLM, SamplingParams
from tests.utils import assert_pool_idle, hf_greedy

NEW_TOKENS = 32
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def save_tiny(config: PretrainedConfig, path: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """Random fp32 HF model saved to `path`; weights widened (std 0.2) so routing and tokens vary,
    norm weights and biases perturbed so that loading them matters. transformers attends with SDPA
    (faster) unless told "eager" (Gemma 2's soft-capping needs it)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or p.dim() == 1:
                p.copy_((0.0 if "bias" in name else 1.0) + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias is a buffer: saved too
                b.copy_(0.3 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


def mixed_prompts(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]  # no 0: transformers' generate masks pad id 0

    shared = toks(12)
    first = [toks(5), toks(23), shared + toks(6), shared + toks(3), toks(40)]
    second = [first[1] + toks(9), first[4][:20] + toks(2)]  # leading blocks already in the cache
    return first, second


def check_greedy_matches_transformers(config: PretrainedConfig, seed: int = 0, attn_implementation: str = "sdpa",
                                      **llm_kwargs) -> None:
    path = tempfile.mkdtemp(prefix="pagedllm-family-")
    try:
        hf = save_tiny(config, path, seed, attn_implementation)
        llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=4, num_gpu_blocks_override=256,
                  enable_prefix_caching=True, max_num_batched_tokens=16, max_num_seqs=8, **llm_kwargs)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        first, second = mixed_prompts(config.vocab_size, seed)
        kv = llm.llm_engine.engine_core.scheduler.kv_cache_manager
        for batch in (first, second):
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            for i, (p, o) in enumerate(zip(batch, outs, strict=True)):
                assert o.outputs[0].token_ids == hf_greedy(hf, p, NEW_TOKENS), f"prompt {i} (len {len(p)})"
        assert kv.prefix_cache_hits >= 16, kv.prefix_cache_hits  # the second call reused cached blocks
        assert_pool_idle(llm)
    finally:
        shutil.rmtree(path, ignore_errors=True)
