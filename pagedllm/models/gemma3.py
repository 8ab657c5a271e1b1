"""Gemma 3 text (Gemma3ForCausalLM, the 1B / text-only checkpoints): Gemma 2's graph with per-head
q/k RMSNorm ((1 + w) like every Gemma norm), no attention soft-cap by default, and a rope per layer
type: `config.rope_parameters` = {"sliding_attention": {rope_theta 10 000}, "full_attention":
{rope_theta 1e6, maybe linear scaling}} (older configs: rope_local_base_freq + rope_theta/rope_scaling).
The multimodal Gemma3ForConditionalGeneration is not registered."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from pagedllm.models.gemma2 import Gemma2Attention, Gemma2DecoderLayer, Gemma2ForCausalLM, Gemma2Model
from pagedllm.models.llama import get_head_dim

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Gemma3Attention(Gemma2Attention):
    use_qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3Model(Gemma2Model):
    @staticmethod
    def make_ropes(config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        ropes = {}
        for layer_type in ("sliding_attention", "full_attention"):
            ropes[layer_type] = get_rope(get_head_dim(config), config.max_position_embeddings,
                                         _rope_parameters(config, layer_type))
        return ropes


def _rope_parameters(config: PretrainedConfig, layer_type: str) -> dict[str, Any]:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params.get(layer_type), dict):  # transformers 5: one entry per layer type
        return dict(params[layer_type])
    flat = get_rope_parameters(config)
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", None) or 10000.0}
    return flat


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    decoder_layer_cls = Gemma3DecoderLayer
    model_cls = Gemma3Model
