"""Decoder base models used as embedders (Qwen3-Embedding, gte-Qwen2, e5-mistral): the Llama-family
graph without an LM head; the pooling runner pools its final-norm hidden states (LAST token by
default, as Qwen3-Embedding's sentence-transformers config says).

Attention stays causal and uses the paged KV cache like generation does; the blocks are freed as
soon as the request's one step is done. A `*ForCausalLM` checkpoint run with runner="pooling" uses
its generation class directly (the LM head is loaded and never called).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, Qwen2DecoderLayer
from pagedllm.models.qwen3 import Qwen3DecoderLayer
from pagedllm.models.utils import load_weights_with_mapping
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class LlamaEmbeddingModel(nn.Module):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, quant_config, prefix="model", decoder_layer_cls=self.decoder_layer_cls)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A base model's checkpoint names its tensors "layers.0...." (no "model." prefix); a
        causal-LM checkpoint's "model.layers.0...." and an LM head, which is not used here."""

        def renamed():
            for name, t in weights:
                if name.startswith("lm_head.") or "rotary_emb.inv_freq" in name:
                    continue
                yield (name if name.startswith("model.") else f"model.{name}"), t

        return load_weights_with_mapping(self, renamed(), LlamaForCausalLM.stacked_params_mapping)


class Qwen2EmbeddingModel(LlamaEmbeddingModel):
    decoder_layer_cls = Qwen2DecoderLayer


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    decoder_layer_cls = Qwen3DecoderLayer
