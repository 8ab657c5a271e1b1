"""Mixture-of-Experts: routing (`router`), the stacked-experts layer (`layer.FusedMoE`), its quant
hook (`method`) and the plain torch experts (`torch_ref`); the Triton kernel is
`pagedllm.kernels.fused_moe`."""

from pagedllm.layers.fused_moe.layer import FusedMoE
from pagedllm.layers.fused_moe.method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from pagedllm.layers.fused_moe.router import select_experts

__all__ = ["FusedMoE", "FusedMoEMethodBase", "UnquantizedFusedMoEMethod", "select_experts"]
