"""`FusedMoE`: the routed experts of one MoE block, stacked into two 3-d weights (vLLM's layout).

    w13_weight (E, 2 * inter / tp, hidden)  [gate (w1); up (w3)] of every expert
    w2_weight  (E, hidden, inter / tp)       down (w2)

Checkpoints store one tensor per expert and projection (Mixtral `experts.3.w1.weight`, Qwen/DeepSeek
`experts.3.gate_proj.weight`); `make_expert_params_mapping` names them and `weight_loader` copies
each into its expert's slice, this rank's part of `inter` only (tensor parallel splits every expert's
intermediate dimension; the partial outputs are all-reduced).

Fused shared experts (DeepSeek, unquantized): `num_fused_shared_experts` S stacks the shared experts
after the E routed ones (w13 / w2 of E + S experts) and the router appends them to every token at
weight 1.0, so one fused MoE runs both instead of the shared MLP's GEMM, SiLU, GEMM and the add. A
shared MLP of S * inter is exactly S experts of inter (its intermediate units split in S runs:
down(silu(gate x) * up x) sums over the units); `split_shared_expert_weights` names the pieces.

Quantization hook: the layer asks `quant_config.get_quant_method(self, prefix)` like a linear layer;
the answer must be a `FusedMoEMethodBase` (it creates the weights and runs the experts), else the
config does not support MoE experts and construction fails naming the layer. FP8 experts:
quantization/fp8_moe.py `Fp8MoEMethod` (its scale parameters load through the same mapping).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.envs import kernel_switches
from pagedllm.layers.fused_moe.method import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from pagedllm.layers.fused_moe.router import select_experts
from pagedllm.layers.tp import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.utils import check_shape, divide
from pagedllm.quantization.base import QuantizationConfig

_SUM_IN_NORM = kernel_switches().moe_sum_in_norm  # PAGEDLLM_MOE_SUM_IN_NORM=0: the top-k sum as its own kernel
# Checkpoint projection -> (our parameter, shard): w1 = gate, w3 = up, w2 = down.
_SHARDS = ("w1", "w2", "w3")


class FusedMoE(nn.Module):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool = True,
        scoring_func: str = "softmax",
        num_expert_group: int | None = None,
        topk_group: int | None = None,
        e_score_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        num_fused_shared_experts: int = 0,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.renormalize = renormalize
        self.scoring_func = scoring_func
        self.num_expert_group = num_expert_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.num_fused_shared_experts = num_fused_shared_experts
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size, f"{prefix}: moe intermediate")
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        if method is not None and not isinstance(method, FusedMoEMethodBase):
            raise ValueError(f"{prefix}: quantization {quant_config.get_name()!r} has no method for MoE experts "
                             f"(got {type(method).__name__})")
        self.quant_method: FusedMoEMethodBase = method or UnquantizedFusedMoEMethod()
        if num_fused_shared_experts and method is not None:
            raise ValueError(f"{prefix}: fused shared experts need unquantized experts")
        self.quant_method.create_weights(
            self, num_experts + num_fused_shared_experts, hidden_size, self.intermediate_size_per_partition,
            params_dtype or torch.get_default_dtype(), weight_loader=self.weight_loader,
        )
        if e_score_correction_bias:
            # DeepSeek-V3 checkpoints: `gate.e_score_correction_bias`; the model moves it here.
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.e_score_correction_bias = None

    @staticmethod
    def make_expert_params_mapping(
        ckpt_gate_proj_name: str, ckpt_down_proj_name: str, ckpt_up_proj_name: str, num_experts: int
    ) -> list[tuple[str, str, tuple[int, str]]]:
        """(our param prefix, checkpoint prefix, (expert_id, shard)) for `load_weights_with_mapping`, e.g.
        (".experts.w13_", ".experts.3.gate_proj.", (3, "w1")): vLLM's form, one entry per expert and
        projection for all of its tensors, "experts.3.gate_proj.weight" -> "experts.w13_weight" and, for
        FP8 experts (quantization/fp8_moe.py), ".weight_scale" / ".input_scale" -> "w13_weight_scale" /
        "w13_input_scale". Every expert's shards are then required of each of those parameters."""
        mapping = []
        for e in range(num_experts):
            for ckpt, shard in ((ckpt_gate_proj_name, "w1"), (ckpt_down_proj_name, "w2"), (ckpt_up_proj_name, "w3")):
                param = "w2_" if shard == "w2" else "w13_"
                mapping.append((f".experts.{param}", f".experts.{e}.{ckpt}.", (e, shard)))
        return mapping

    @staticmethod
    def split_shared_expert_weights(name: str, tensor: torch.Tensor, shared_prefix: str, experts_prefix: str,
                                    num_experts: int, num_shared: int) -> list[tuple[str, torch.Tensor]]:
        """A shared MLP's checkpoint tensor -> its num_shared expert tensors, named as routed experts
        E, E + 1, ...: `mlp.shared_experts.gate_proj.weight` (S * inter, hidden) -> rows
        [j * inter, (j + 1) * inter) as `mlp.experts.{E + j}.gate_proj.weight`; down_proj
        (hidden, S * inter) -> its columns likewise. Other names come back unchanged."""
        if shared_prefix not in name:
            return [(name, tensor)]
        proj = name.split(shared_prefix, 1)[1]  # "gate_proj.weight"
        dim = 1 if proj.startswith("down_proj") else 0
        return [(name.replace(shared_prefix, f"{experts_prefix}{num_experts + j}."), piece.contiguous())
                for j, piece in enumerate(tensor.chunk(num_shared, dim=dim))]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """One expert's checkpoint tensor (gate/up (inter, hidden), down (hidden, inter)) -> its slice."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] in _SHARDS):
            raise ValueError(f"{self.prefix}: expert shard id must be (expert_id, 'w1'|'w2'|'w3'), got {shard_id!r}")
        expert_id, shard = shard_id
        total = self.num_experts + self.num_fused_shared_experts
        if not 0 <= expert_id < total:
            raise ValueError(f"{self.prefix}: expert {expert_id} out of range ({total} experts)")
        inter = self.intermediate_size_per_partition
        start = self.tp_rank * inter
        if shard == "w2":
            check_shape(f"{self.prefix} expert {expert_id} w2", (self.hidden_size, self.intermediate_size),
                        loaded_weight.shape)
            param.data[expert_id].copy_(loaded_weight[:, start : start + inter])
            return
        check_shape(f"{self.prefix} expert {expert_id} {shard}", (self.intermediate_size, self.hidden_size),
                    loaded_weight.shape)
        offset = 0 if shard == "w1" else inter
        param.data[expert_id, offset : offset + inter].copy_(loaded_weight[start : start + inter])

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor, sum_topk: bool = True) -> torch.Tensor:
        """hidden_states (T, hidden), router_logits (T, E) -> (T, hidden), summed over ranks. sum_topk=False
        (only where `can_leave_topk_unsummed`): the (T, top_k + shared, hidden) expert outputs unsummed,
        for the next residual add + RMSNorm to sum (Qwen2/3-MoE, Mixtral and DeepSeek blocks)."""
        if not sum_topk and not self.can_leave_topk_unsummed(hidden_states):
            raise ValueError(f"{self}: the top-k outputs can be left unsummed only on one CUDA rank and stage, "
                             "with unquantized or FP8 experts")
        topk_weights, topk_ids = select_experts(
            router_logits, self.top_k, self.renormalize, self.scoring_func, self.num_expert_group,
            self.topk_group, self.e_score_correction_bias, self.routed_scaling_factor, self.num_fused_shared_experts,
        )
        if not sum_topk:
            return self.quant_method.apply_unsummed(self, hidden_states, topk_weights, topk_ids)
        out = self.quant_method.apply(self, hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def can_leave_topk_unsummed(self, hidden_states: torch.Tensor) -> bool:
        """Whether forward(..., sum_topk=False) may hand back the top-k outputs unsummed: the
        dense or FP8 experts (a method with supports_unsummed_topk) on CUDA, one tensor-parallel rank
        (the sum must come before an all-reduce) and one pipeline stage (stage hand-offs have
        (T, hidden) buffers)."""
        from pagedllm.distributed.parallel_state import get_pp_group

        return (_SUM_IN_NORM and hidden_states.is_cuda and self.tp_size == 1
                and self.quant_method.supports_unsummed_topk and get_pp_group().world_size == 1)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"inter_per_rank={self.intermediate_size_per_partition}, scoring={self.scoring_func}")
