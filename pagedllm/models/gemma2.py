"""Gemma 2 and Gemma 3 (text): Llama's attention and gated MLP with Gemma's differences.

    embed_tokens * sqrt(hidden)                       (the normalizer, rounded to the model dtype)
    N x [RMSNorm -> attention -> RMSNorm (post_attention) -> +residual
         RMSNorm (pre_feedforward) -> GeGLU MLP (gelu tanh) -> RMSNorm (post_feedforward) -> +residual]
    RMSNorm -> lm_head (tied) -> cap * tanh(logits / cap)   (final_logit_softcapping, Gemma 2)

Every RMSNorm multiplies by (1 + w) (`GemmaRMSNorm`). Attention scale is query_pre_attn_scalar^-0.5;
Gemma 2 soft-caps attention scores (attn_logit_softcapping); layers alternate sliding-window
("sliding_attention" in config.layer_types, window config.sliding_window) and global attention.
Gemma 3 adds per-head q/k RMSNorm and a separate rope per layer type (local layers: base 10 000,
global: rope_theta with its scaling), see `gemma3.py`.

KV cache: sliding layers keep every block of a request (blocks older than the window are masked,
not freed: the global layers share the block table and read them all), so a request costs the same
cache as on a global layer (core/kv_cache_manager.py frees blocks only when every layer is windowed).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, get_head_dim, layer_index
from pagedllm.models.utils import single_stage, sliding_window_for_layer
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


class GemmaMLP(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act not in _GELU_TANH:
            raise ValueError(f"{prefix}: unsupported hidden_activation {act!r}; supported: {list(_GELU_TANH)}")
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")
        self.act_fn = GeluAndMul(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma2Attention(LlamaAttention):
    use_qk_norm = False

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, rotary_emb, quant_config, bias=bias, bias_o_proj=bias, prefix=prefix)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(f"{prefix}: use_bidirectional_attention (EmbeddingGemma) is not supported")
        self.scaling = float(config.query_pre_attn_scalar) ** -0.5
        self.attn = Attention(self.num_heads, self.head_dim, self.scaling, self.num_kv_heads, prefix=f"{prefix}.attn",
                              sliding_window=sliding_window_for_layer(config, layer_index(prefix)),
                              logits_soft_cap=getattr(config, "attn_logit_softcapping", None))
        if self.use_qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        out = self.attn.forward_qkv(qkv, positions, self.rotary_emb, attn_metadata, q_norm=self.q_norm,
                                    k_norm=self.k_norm)
        return self.o_proj(out)


class Gemma2DecoderLayer(nn.Module):
    attention_cls: type[Gemma2Attention] = Gemma2Attention

    def __init__(self, config: PretrainedConfig, rotary_emb: RotaryEmbedding,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, rotary_emb, quant_config, prefix=f"{prefix}.self_attn")
        self.mlp = GemmaMLP(config, quant_config, prefix=f"{prefix}.mlp")
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                attn_metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, attn_metadata))
        # residual += attention output; the MLP reads the normalised sum.
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


class Gemma2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 decoder_layer_cls: type[nn.Module] = Gemma2DecoderLayer) -> None:
        super().__init__()
        self.config = config
        single_stage(self, type(self).__name__)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, quant_config=quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        ropes = self.make_ropes(config)
        self.layers = nn.ModuleList(
            decoder_layer_cls(config, ropes[self.layer_type(config, i)], quant_config, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.normalizer = config.hidden_size**0.5

    @staticmethod
    def layer_type(config: PretrainedConfig, index: int) -> str:
        return "sliding_attention" if sliding_window_for_layer(config, index) else "full_attention"

    @staticmethod
    def make_ropes(config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        """Gemma 2: one rope for every layer (both layer types share it)."""
        rope = get_rope(get_head_dim(config), config.max_position_embeddings, get_rope_parameters(config))
        return {"sliding_attention": rope, "full_attention": rope}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate_tensors: object = None) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # one stage: intermediate_tensors is always None
        # transformers multiplies by the normalizer rounded to the model dtype (sqrt(3072) in bf16 is 55.5).
        hidden_states = hidden_states * torch.tensor(self.normalizer, dtype=hidden_states.dtype)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Gemma2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer
    model_cls = Gemma2Model

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Gemma always ties lm_head to the embedding; some checkpoints still carry an lm_head copy.
        return super().load_weights((n, t) for n, t in weights if not n.startswith("lm_head."))
