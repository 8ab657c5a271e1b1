"""Tiny random HF models saved to disk, for tests that compare against transformers (fp32, CPU)."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

# name -> (config class, extra config kwargs)
ARCHS: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            vocab_size=512,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "llama-tied": ("LlamaConfig", dict(vocab_size=512, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(vocab_size=512, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(vocab_size=512, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(vocab_size=512, head_dim=32, tie_word_embeddings=False)),
}


@functools.cache
def tiny_model(arch: str, vocab_size: int | None = None, with_tokenizer: bool = False) -> tuple[str, torch.nn.Module]:
    """Save a seeded random model (and optionally SmolLM2's tokenizer beside it); cached per session."""
    cls_name, extra = ARCHS[arch]
    kw = {**TINY, **extra}
    if vocab_size is not None:
        kw["vocab_size"] = vocab_size
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    # Random init is tiny; widen the spread so greedy tokens differ between positions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    path = Path(tempfile.mkdtemp(prefix=f"pagedllm-{arch}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    model.save_pretrained(path)
    if with_tokenizer:
        smollm_tokenizer().save_pretrained(path)
    return str(path), model


def write_tiny_cross_encoder(path: Path) -> None:
    """A tiny random BERT cross-encoder (one label) with all-MiniLM-L6-v2's tokenizer, saved under `path`."""
    from pagedllm.pooling.embedded import embedded_embedding_model_path

    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=64, max_position_embeddings=512, num_labels=1)
    transformers.BertForSequenceClassification(cfg).save_pretrained(path)
    transformers.AutoTokenizer.from_pretrained(embedded_embedding_model_path()).save_pretrained(path)


@functools.cache
def smollm_tokenizer():
    from pagedllm.loader import get_tokenizer, resolve_model

    return get_tokenizer(resolve_model(None))


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """transformers' greedy tokens. Its generate masks pad tokens (id 0 here) out of the prompt, so
    prompts that are compared must not hold token 0."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate_kwargs,
        )
    return out[0, len(prompt) :].tolist()


def track_peak_blocks(kv_cache_manager) -> list[int]:
    """Wrap `allocate_slots` of an engine's KVCacheManager so the returned one-element list holds the
    most blocks in use after any allocation (a sliding window's bound on the pool, for example)."""
    kv = kv_cache_manager
    peak = [0]
    allocate = kv.allocate_slots

    def tracked(*args, **kwargs):
        out = allocate(*args, **kwargs)
        peak[0] = max(peak[0], kv.num_blocks - kv.block_pool.get_num_free_blocks())
        return out

    kv.allocate_slots = tracked
    return peak


def assert_pool_idle(llm) -> None:
    """Every KV block is back in the free pool and no request is left anywhere."""
    core = llm.llm_engine.engine_core
    kv = core.scheduler.kv_cache_manager
    assert not core.scheduler.has_unfinished_requests()
    assert not llm.llm_engine.output_processor.has_unfinished_requests()
    assert kv.block_pool.get_num_free_blocks() == kv.num_blocks
    kv.check_invariants()
