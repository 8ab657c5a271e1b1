"""Architecture name (config.architectures[0]) -> model class, imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# architecture -> (module under pagedllm.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v2", "DeepseekV3ForCausalLM"),
    # Pooling models (runner="pooling"): encoders, cross-encoders, decoder base models as embedders.
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "XLMRobertaModel": ("xlm_roberta", "XLMRobertaModel"),
    "XLMRobertaForSequenceClassification": ("xlm_roberta", "XLMRobertaForSequenceClassification"),
    "LlamaModel": ("decoder_embedding", "LlamaEmbeddingModel"),
    "MistralModel": ("decoder_embedding", "LlamaEmbeddingModel"),
    "Qwen2Model": ("decoder_embedding", "Qwen2EmbeddingModel"),
    "Qwen3Model": ("decoder_embedding", "Qwen3EmbeddingModel"),
}

# Architectures that can only pool (no LM head): runner="auto" picks "pooling" for them.
POOLING_ONLY_ARCHS = frozenset(
    a for a in _MODELS if a.endswith(("Model", "ForSequenceClassification"))
)


def get_supported_archs() -> list[str]:
    return sorted(_MODELS)


def resolve_model_cls(hf_config: PretrainedConfig) -> type[nn.Module]:
    """LlamaConfig(architectures=["LlamaForCausalLM"]) -> pagedllm.models.llama.LlamaForCausalLM."""
    architectures = getattr(hf_config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"model config has no 'architectures' entry; supported: {get_supported_archs()}")
    arch = architectures[0]
    if arch not in _MODELS:
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {get_supported_archs()}")
    module_name, cls_name = _MODELS[arch]
    module = importlib.import_module(f"pagedllm.models.{module_name}")
    return getattr(module, cls_name)
