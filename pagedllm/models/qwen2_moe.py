"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 attention, sparse MLP blocks with a shared expert.

    mlp: gate -> softmax top-k (renormalised only if norm_topk_prob) -> FusedMoE(experts)
         + sigmoid(shared_expert_gate(x)) * shared_expert(x)
A layer is sparse when it is not in mlp_only_layers and (index + 1) % decoder_sparse_step == 0;
other layers keep a dense MLP of intermediate_size.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, layer_index
from pagedllm.models.utils import load_weights_with_mapping
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def is_sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Qwen2/3-MoE's placement rule (transformers' `Qwen2MoeDecoderLayer`)."""
    return (index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {config.hidden_act!r}; only 'silu' is supported")
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        if shared > 0:
            self.shared_expert = LlamaMLP(config.hidden_size, shared, config.hidden_act, quant_config,
                                          prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden); without a shared expert on one CUDA rank, the experts' top-k
        outputs unsummed, (T, top_k, hidden): the next layer's residual add + RMSNorm sums them
        (kernels/rmsnorm.py), so the sum is no kernel of its own."""
        if self.shared_expert is None and self.experts.can_leave_topk_unsummed(x):
            return self.experts(x, self.gate(x), sum_topk=False)
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    sparse_block_cls: type[nn.Module] = Qwen2MoeSparseMoeBlock

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return bool(getattr(config, "qkv_bias", True)), False

    def make_mlp(self, config, quant_config, prefix):
        if is_sparse_layer(config, layer_index(prefix)):
            return self.sparse_block_cls(config, quant_config, prefix)
        return super().make_mlp(config, quant_config, prefix)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2MoeDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Expert entries first: ".gate_proj" of the dense mapping would also match "experts.3.gate_proj".
        mapping = FusedMoE.make_expert_params_mapping("gate_proj", "down_proj", "up_proj", self.config.num_experts)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        return load_weights_with_mapping(
            self, weights, mapping + self.stacked_params_mapping,
            lambda n: "rotary_emb.inv_freq" in n or (tied and n.startswith("lm_head.")),
        )
