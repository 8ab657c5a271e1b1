"""Mixtral: the Mistral graph with every MLP replaced by a sparse block of routed experts.

    block_sparse_moe: gate (hidden -> E router logits) -> softmax top-k (renormalised) ->
                      FusedMoE(experts.{e}.w1 gate, w3 up, w2 down)

Checkpoint names `model.layers.N.block_sparse_moe.*` load into `model.layers.N.mlp.*`.
Mixtral's sliding window (none in 8x7B / 8x22B configs) is applied like Mistral's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.utils import load_weights_with_mapping
from pagedllm.quantization.base import QuantizationConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralMoE(nn.Module):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"{prefix}: unsupported hidden_act {config.hidden_act!r}; only 'silu' is supported")
        # The router stays dense (as vLLM): E outputs are too few to quantize usefully.
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True, quant_config=quant_config,
                                prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (T, hidden) -> router (T, E) -> (T, hidden), or on one CUDA rank the top-k outputs unsummed,
        # (T, top_k, hidden), summed by the next residual add + RMSNorm (kernels/rmsnorm.py).
        return self.experts(x, self.gate(x), sum_topk=not self.experts.can_leave_topk_unsummed(x))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, quant_config, prefix):
        return MixtralMoE(config, quant_config, prefix)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapping = FusedMoE.make_expert_params_mapping("w1", "w2", "w3", self.config.num_local_experts)
        renamed = ((name.replace(".block_sparse_moe.", ".mlp."), t) for name, t in weights)
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        return load_weights_with_mapping(
            self, renamed, mapping + self.stacked_params_mapping,
            lambda n: "rotary_emb.inv_freq" in n or (tied and n.startswith("lm_head.")),
        )
