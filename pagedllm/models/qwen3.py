"""Qwen3 dense: the Llama graph plus a per-head RMSNorm on q and k before rope (q_norm, k_norm),
and head_dim taken from the config (Qwen3-0.6B: 16 heads x 128 = 2048 != hidden 1024)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3Attention(LlamaAttention):
    def __init__(
        self,
        config: PretrainedConfig,
        rotary_emb: RotaryEmbedding,
        quant_config: QuantizationConfig | None = None,
        bias: bool = False,
        bias_o_proj: bool = False,
        prefix: str = "",
    ) -> None:
        super().__init__(config, rotary_emb, quant_config, bias, bias_o_proj, prefix)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        # The layer normalises every head separately (q_norm/k_norm over head_dim), then ropes.
        attn_output = self.attn.forward_qkv(qkv, positions, self.rotary_emb, attn_metadata,
                                            q_norm=self.q_norm, k_norm=self.k_norm)
        return self.o_proj(attn_output)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
