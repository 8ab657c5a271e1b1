from __future__ import annotations

import pytest
from transformers import LlamaConfig, Qwen3Config

from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.registry import get_supported_archs, resolve_model_cls


@pytest.mark.parametrize(
    "arch, cls",
    [("LlamaForCausalLM", LlamaForCausalLM), ("MistralForCausalLM", MistralForCausalLM),
     ("Qwen2ForCausalLM", Qwen2ForCausalLM), ("Qwen3ForCausalLM", Qwen3ForCausalLM)],
)
def test_resolves_supported_architectures(arch: str, cls: type) -> None:
    assert resolve_model_cls(LlamaConfig(architectures=[arch])) is cls


def test_unsupported_architecture_names_the_supported_list() -> None:
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        resolve_model_cls(LlamaConfig(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="architectures"):
        resolve_model_cls(Qwen3Config())
    assert get_supported_archs() == sorted(get_supported_archs())
