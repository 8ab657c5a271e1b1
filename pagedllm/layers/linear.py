"""Linear layers that know how they are split over tensor-parallel ranks (vLLM's names and shapes).

    ReplicatedLinear            every rank holds the whole W
    ColumnParallelLinear        W split by output rows:  rank r holds W[r*out/tp : (r+1)*out/tp]
    MergedColumnParallelLinear  several column layers fused, e.g. [gate; up] of the MLP
    QKVParallelLinear           [q; k; v] fused; KV heads are replicated when tp > num_kv_heads
    RowParallelLinear           W split by input columns; partial sums are all-reduced

Weights are created by the layer's quant method and loaded by `param.weight_loader(param,
loaded_weight, shard_id)`, which takes the *full* checkpoint tensor and copies this rank's slice
into the right rows of the (possibly fused) parameter. Example, QKVParallelLinear with 4 q heads,
2 kv heads, head_size 16, tp 1: weight is (128, hidden); shard "q" fills rows 0..63, "k" 64..95,
"v" 96..127.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.layers.tp import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from pagedllm.layers.utils import check_shape, default_weight_loader, divide, set_weight_attrs
from pagedllm.quantization.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod


def load_slice(
    param: torch.Tensor,
    loaded_weight: torch.Tensor,
    dim: int,
    param_offset: int,
    size: int,
    loaded_offset: int,
    loaded_total: int,
    what: str,
) -> None:
    """param[param_offset : +size] <- loaded_weight[loaded_offset : +size], both along `dim`.

    Offsets and sizes are logical (unpacked) counts; a parameter packed along `dim` (`packed_dim`,
    `pack_factor` attributes, e.g. 8 int4 values per int32) is addressed in packed units, and one
    holding one value per group of inputs (`group_dims` {dim: group_size}: a GPTQ scale row per 128
    inputs) in groups. `loaded_total` is the size the checkpoint tensor must have along `dim`.
    """
    factor = param.pack_factor if getattr(param, "packed_dim", None) == dim else 1
    factor *= getattr(param, "group_dims", {}).get(dim, 1)
    if factor != 1:
        param_offset, size = param_offset // factor, size // factor
        loaded_offset, loaded_total = loaded_offset // factor, loaded_total // factor
    if loaded_weight.dim() != param.dim() or loaded_weight.shape[dim] != loaded_total:
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded_weight.shape)}, expected {loaded_total} "
            f"along dim {dim} of a {param.dim()}-d tensor"
        )
    dst = param.data.narrow(dim, param_offset, size)
    src = loaded_weight.narrow(dim, loaded_offset, size)
    check_shape(what, dst.shape, src.shape)
    dst.copy_(src)


class LinearBase(nn.Module):
    """Shared setup: TP rank/size, params dtype, and the quant method that owns the weights."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.prefix = prefix
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.tp_group = get_tp_group()  # taken once: forward's collectives read no process state
        method = quant_config.get_quant_method(self, prefix) if quant_config is not None else None
        self.quant_method: LinearMethodBase = method or UnquantizedLinearMethod()

    def _create_bias(self, size: int, output_dim: int | None) -> None:
        bias = nn.Parameter(torch.empty(size, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, {"output_dim": output_dim, "weight_loader": self.weight_loader})
        self.register_parameter("bias", bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, output_features={self.output_size}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")


class ReplicatedLinear(LinearBase):
    """The full W on every rank (small projections that are not worth splitting)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.quant_method.create_weights(
            self, input_size, [output_size], input_size, output_size, self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(output_size, output_dim=None)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: ReplicatedLinear takes no shard id, got {shard_id!r}")
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Y = X W^T with W split by output rows; each rank produces its slice of Y's columns.

    gather_output=True all-gathers the slices so every rank sees the full Y; the models here keep
    the output split because the next layer (attention heads, RowParallelLinear) consumes a slice.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        output_sizes: list[int] | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.gather_output = gather_output
        self.output_size_per_partition = divide(output_size, self.tp_size, f"{prefix}: output size")
        # Logical sub-matrices fused into this layer (full sizes) and this rank's rows of each.
        self.output_sizes = output_sizes if output_sizes is not None else [output_size]
        self.output_partition_sizes = self._partition_sizes()
        self.quant_method.create_weights(
            self, input_size, self.output_partition_sizes, input_size, output_size, self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(self.output_size_per_partition, output_dim=0)
        else:
            self.register_parameter("bias", None)

    def _partition_sizes(self) -> list[int]:
        return [divide(s, self.tp_size, f"{self.prefix}: output size") for s in self.output_sizes]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: ColumnParallelLinear takes no shard id, got {shard_id!r}")
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            default_weight_loader(param, loaded_weight)
            return
        size = self.output_size_per_partition
        load_slice(param, loaded_weight, output_dim, 0, size, self.tp_rank * size, self.output_size,
                   self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, x, self.bias)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, group=self.tp_group)
        return out

    def fuses_rms_norm(self, x: torch.Tensor) -> bool:
        """Whether `forward_rms_norm(x, residual, norm)` folds the residual add + RMSNorm before this
        layer into its GEMV (the quant method says so: int4 one-row decode)."""
        fuses = getattr(self.quant_method, "fuses_rms_norm", None)
        return fuses is not None and fuses(self, x)

    def forward_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """(forward(norm(x, residual)[0]), x + residual) with `norm` an RMSNorm (weight, variance_epsilon),
        the norm computed inside the quant method's GEMV (no launch of its own)."""
        out, new_residual = self.quant_method.apply_rms_norm(self, x, residual, norm.weight, norm.variance_epsilon,
                                                             self.bias)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, group=self.tp_group)
        return out, new_residual


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers with the same input, fused into one matmul.

    LlamaMLP: output_sizes [intermediate, intermediate] holds [gate_proj; up_proj]; the checkpoint's
    gate_proj.weight loads with shard_id 0, up_proj.weight with shard_id 1. With tp 2 each rank
    holds [gate[r half]; up[r half]], so the SiluAndMul split in the middle stays correct.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias, gather_output, params_dtype, quant_config,
                         output_sizes=list(output_sizes), prefix=prefix)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: int | None = None) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            default_weight_loader(param, loaded_weight)
            return
        if shard_id is None:
            # A checkpoint that already stores the fused tensor: load every sub-matrix from it.
            loaded_start = 0
            for i, full in enumerate(self.output_sizes):
                self._load_shard(param, loaded_weight, output_dim, i, loaded_start, self.output_size)
                loaded_start += full
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"{self.prefix}: shard id must be an int in [0, {len(self.output_sizes)}), "
                             f"got {shard_id!r}")
        self._load_shard(param, loaded_weight, output_dim, shard_id, 0, self.output_sizes[shard_id])

    def _load_shard(self, param, loaded_weight, output_dim: int, shard_id: int, loaded_start: int,
                    loaded_total: int) -> None:
        size = self.output_partition_sizes[shard_id]
        param_offset = sum(self.output_partition_sizes[:shard_id])
        load_slice(param, loaded_weight, output_dim, param_offset, size, loaded_start + self.tp_rank * size,
                   loaded_total, f"{self.prefix} shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """[q; k; v] projections fused, split by heads.

    Each rank gets total_num_heads / tp query heads. KV heads are split the same way when there
    are at least tp of them; otherwise each KV head is replicated on tp / total_num_kv_heads ranks
    (Llama-70B: 8 kv heads, tp 16 -> 1 kv head per rank, ranks 2r and 2r+1 share kv head r).
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, f"{prefix}: num_heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, f"{prefix}: tp over kv heads")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, f"{prefix}: num_kv_heads")
            self.num_kv_head_replicas = 1
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        # The layer's "full" output as if every rank's slice were concatenated (kv counted per replica).
        output_size = (q_size + 2 * kv_size) * tp_size
        super().__init__(
            hidden_size, output_size, bias, False, params_dtype, quant_config,
            output_sizes=[total_num_heads * head_size, total_num_kv_heads * head_size,
                          total_num_kv_heads * head_size],
            prefix=prefix,
        )

    _SHARD_INDEX = {"q": 0, "k": 1, "v": 2}

    def _partition_sizes(self) -> list[int]:
        # Not output_sizes / tp: replicated kv heads make each rank's k and v one full head group.
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return [q_size, kv_size, kv_size]

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str | None = None) -> None:
        output_dim = getattr(param, "output_dim", None)
        if output_dim is None:
            default_weight_loader(param, loaded_weight)
            return
        if shard_id is None:
            # Fused checkpoint tensor (e.g. Phi-3's qkv_proj): rows [q_all; k_all; v_all].
            loaded_start = 0
            for name, full in zip("qkv", self.output_sizes, strict=True):
                self._load_shard(param, loaded_weight, output_dim, name, loaded_start, sum(self.output_sizes))
                loaded_start += full
            return
        if shard_id not in self._SHARD_INDEX:
            raise ValueError(f"{self.prefix}: shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        full = self.output_sizes[self._SHARD_INDEX[shard_id]]
        self._load_shard(param, loaded_weight, output_dim, shard_id, 0, full)

    def _load_shard(self, param, loaded_weight, output_dim: int, shard_id: str, loaded_start: int,
                    loaded_total: int) -> None:
        index = self._SHARD_INDEX[shard_id]
        size = self.output_partition_sizes[index]
        param_offset = sum(self.output_partition_sizes[:index])
        # Which of the checkpoint's head groups this rank holds.
        shard_rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.num_kv_head_replicas
        load_slice(param, loaded_weight, output_dim, param_offset, size, loaded_start + shard_rank * size,
                   loaded_total, f"{self.prefix} shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Y = X W^T with W split by input columns; X arrives split the same way (from a column layer).

    Each rank computes a partial Y over its input slice; reduce_results all-reduces them. The bias
    is added on rank 0 only, so the sum counts it once.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        reduce_results: bool = True,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, params_dtype, quant_config, prefix)
        self.reduce_results = reduce_results
        self.input_size_per_partition = divide(input_size, self.tp_size, f"{prefix}: input size")
        self.output_partition_sizes = [output_size]
        self.quant_method.create_weights(
            self, self.input_size_per_partition, [output_size], input_size, output_size, self.params_dtype,
            weight_loader=self.weight_loader,
        )
        if bias:
            self._create_bias(output_size, output_dim=None)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix}: RowParallelLinear takes no shard id, got {shard_id!r}")
        input_dim = getattr(param, "input_dim", None)
        if input_dim is None:  # the bias, or a per-tensor scale: the same on every rank
            default_weight_loader(param, loaded_weight)
            return
        size = self.input_size_per_partition
        load_slice(param, loaded_weight, input_dim, 0, size, self.tp_rank * size, self.input_size, self.prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply(self, x, bias)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, group=self.tp_group)
        return out

    def fuses_silu_and_mul(self, gate_up: torch.Tensor) -> bool:
        """Whether `forward_silu_and_mul(gate_up)` folds SwiGLU's activation into this layer's GEMV (the
        quant method says so: int4 one-row decode)."""
        fuses = getattr(self.quant_method, "fuses_silu_and_mul", None)
        return fuses is not None and fuses(self, gate_up)

    def forward_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) for gate_up = [gate | up] (T, 2 * input_size_per_partition), the
        activation computed inside the quant method's GEMV (no launch of its own)."""
        bias = self.bias if self.tp_rank == 0 else None
        out = self.quant_method.apply_silu_and_mul(self, gate_up, bias)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out, group=self.tp_group)
        return out
