"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (per-head q/k RMSNorm, no qkv bias)
and Qwen2-MoE's sparse blocks without the shared expert (renormalised top-k: norm_topk_prob)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM
from pagedllm.models.qwen3 import Qwen3Attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer
