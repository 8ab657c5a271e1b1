"""How a `FusedMoE` layer stores and runs its experts: the MoE side of the quantization hook.

A quantization scheme that supports MoE (FP8 experts, ...) returns a subclass of
`FusedMoEMethodBase` from `QuantizationConfig.get_quant_method(layer, prefix)` when `layer` is a
`FusedMoE`: it registers its own parameters in `create_weights` (e.g. fp8 w13/w2 plus per-expert
scales, each with `weight_loader` attached, which receives (param, tensor, (expert_id, shard))) and
computes in `apply`. `UnquantizedFusedMoEMethod` is the dense one.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import nn

from pagedllm.layers.utils import set_weight_attrs
from pagedllm.quantization.base import QuantizeMethodBase


class FusedMoEMethodBase(QuantizeMethodBase):
    # Whether `apply_unsummed` is built: the top-k outputs left unsummed for the next residual add +
    # RMSNorm to sum (FusedMoE.can_leave_topk_unsummed; the fused kernels on CUDA).
    supports_unsummed_topk: bool = False

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None: ...

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # (T, hidden)
        topk_weights: torch.Tensor,  # (T, top_k) float32
        topk_ids: torch.Tensor,  # (T, top_k) int32
    ) -> torch.Tensor:  # (T, hidden), this rank's partial sum
        ...

    def apply_unsummed(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:  # (T, top_k, hidden)
        """`apply` without the top-k sum (only where supports_unsummed_topk)."""
        raise NotImplementedError(f"{type(self).__name__} always sums the top-k outputs")


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Dense experts in the model dtype: Triton grouped GEMMs on CUDA, the torch reference elsewhere."""

    supports_unsummed_topk = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size_per_partition, hidden_size,
                                       dtype=params_dtype), requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size_per_partition,
                                      dtype=params_dtype), requires_grad=False)
        for p in (w13, w2):
            set_weight_attrs(p, extra_weight_attrs)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply(self, layer, x, topk_weights, topk_ids):
        if x.is_cuda:
            from pagedllm.kernels.fused_moe import fused_experts

            return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                 shared_experts=layer.num_fused_shared_experts)
        from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

        return fused_experts_ref(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)

    def apply_unsummed(self, layer, x, topk_weights, topk_ids):
        from pagedllm.kernels.fused_moe import fused_experts

        return fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             shared_experts=layer.num_fused_shared_experts, sum_topk=False)
