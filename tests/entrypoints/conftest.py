"""Fixtures shared by the entrypoint tests: a tiny random Llama with SmolLM2's real tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def make_tiny_model(path: Path) -> Path:
    """A random 2-layer Llama with SmolLM2's tokenizer (49152 tokens) and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.loader.source import resolve_model
    from pagedllm.loader.tokenizer import get_tokenizer

    tok = get_tokenizer(resolve_model(None))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        # 0.2 (not 0.02): varied text instead of one token repeated, so stop strings can be tested.
        initializer_range=0.2, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
