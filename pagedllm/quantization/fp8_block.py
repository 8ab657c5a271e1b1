"""The block-wise FP8 linear method: `fp8` checkpoints with `weight_block_size` [block_n, block_k].

Parameters a checkpoint fills (names as DeepSeek-V3 / Qwen3-FP8 / vLLM write them):

    weight            (rows, in_pp) float8_e4m3fn                      input_dim 1, output_dim 0
    weight_scale_inv  (ceil(rows / bn), ceil(in_pp / bk)) fp32: one multiplier per (bn, bk) block,
                      w[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]
                      (compressed-tensors' block scheme, FP8_BLOCK, names the same grid `weight_scale`)

rows = sum(output_partition_sizes) on this rank. Fused layers (q/k/v, gate/up) stack their shards'
scale rows as they stack their weight rows: shard "k" of a qkv_proj with q 4096, k 1024 rows and
bn 128 fills scale rows 32..39. That needs every shard's rows (and, with tensor parallelism, every
rank's slice of rows or inputs) to be whole blocks, as vLLM requires; a layer that is not is refused
at start, naming the layer, the size and the block. An unsplit layer may end in a ragged block
(rows 100, bn 64: 2 scale rows, the second covering rows 64..99).

Activations: dynamic only, per token and group of bk inputs. Compute: kernels/fp8_block_gemm.py
(`fp8_block_linear`: Triton on CUDA, the torch reference on the CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import triton
from torch import nn

from pagedllm.kernels.fp8_block_gemm import FP8_DTYPE, fp8_block_linear
from pagedllm.quantization.base import LinearMethodBase
from pagedllm.quantization.utils import FLOAT_DTYPES, add_param, checked_loader


def parse_block(value: Any, what: str) -> tuple[int, int]:
    """A config's block shape ([block_n, block_k]: fp8's weight_block_size, compressed-tensors' block_structure),
    two positive ints, else a ValueError naming `what` and the value."""
    if (not isinstance(value, list | tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{what} must be [block_n, block_k], two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def check_block_partitions(prefix: str, block: tuple[int, int], input_size_per_partition: int,
                           output_partition_sizes: list[int], input_size: int, output_size: int) -> None:
    """ValueError unless every slice the loaders cut (fused shards' rows, a TP rank's rows or inputs)
    is a whole number of (bn, bk) blocks, so each slice's scales are whole rows / columns of the grid."""
    bn, bk = block
    if input_size_per_partition != input_size and input_size_per_partition % bk:
        raise ValueError(f"{prefix}: this rank's input partition of {input_size_per_partition} (of {input_size}) is "
                         f"not a multiple of the fp8 weight block's block_k {bk} (weight_block_size {list(block)}); "
                         "use a tensor_parallel_size that splits the inputs in whole blocks")
    split_rows = len(output_partition_sizes) > 1 or sum(output_partition_sizes) != output_size
    if split_rows:
        for size in output_partition_sizes:
            if size % bn:
                raise ValueError(f"{prefix}: output partition {size} (of partitions {output_partition_sizes}) is "
                                 f"not a multiple of the fp8 weight block's block_n {bn} (weight_block_size "
                                 f"{list(block)}); fused shards and tensor-parallel slices need whole blocks")


def block_scale_loader(layer: nn.Module, inner: Callable[..., None], what: str, block: tuple[int, int],
                       whole: bool) -> Callable[..., None]:
    """Loader of `weight_scale_inv`. whole (this rank holds the layer's entire block grid: one partition,
    no TP split): the checkpoint tensor must have the parameter's shape exactly (ragged last blocks
    included). Otherwise the layer's own loader slices it, in block units (the parameter's `group_dims`
    {0: bn, 1: bk}: shard "k"'s offset of 4096 rows is 32 scale rows), the slices being whole blocks
    (`check_block_partitions`)."""
    bn, bk = block

    def load(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
        if loaded.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{what}: checkpoint tensor has dtype {str(loaded.dtype).removeprefix('torch.')}, "
                             f"expected float32 (one scale per ({bn}, {bk}) weight block)")
        loaded = loaded.float()
        if whole and shard_id is None:
            if tuple(loaded.shape) != tuple(param.shape):
                raise ValueError(f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                                 f"{tuple(param.shape)} (one scale per ({bn}, {bk}) block of the "
                                 f"({layer.output_size}, {layer.input_size}) weight)")
            param.data.copy_(loaded)
            return
        try:
            if shard_id is None:
                inner(param, loaded)
            else:
                inner(param, loaded, shard_id)
        except ValueError as e:  # the layer's message counts scale blocks: say so, and name the tensor
            raise ValueError(f"{what}: {e} (counted in ({bn}, {bk}) weight blocks)") from e

    return load


class Fp8BlockLinearMethod(LinearMethodBase):
    """y = x W^T with W in float8_e4m3fn and one fp32 scale per (block_n, block_k) block; activations
    quantized dynamically per token and group of block_k inputs."""

    def __init__(self, block: tuple[int, int], scale_name: str = "weight_scale_inv") -> None:
        self.block = (int(block[0]), int(block[1]))
        self.scale_name = scale_name  # the checkpoint's name of the scale grid: fp8's, or compressed-tensors'

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        loader = extra_weight_attrs.pop("weight_loader")
        prefix = getattr(layer, "prefix", "")
        bn, bk = self.block
        check_block_partitions(prefix, self.block, input_size_per_partition, output_partition_sizes, input_size,
                               output_size)
        rows = sum(output_partition_sizes)
        add_param(layer, "weight", torch.empty(rows, input_size_per_partition, dtype=FP8_DTYPE),
                  {"input_dim": 1, "output_dim": 0, **extra_weight_attrs,
                   "weight_loader": checked_loader(loader, f"{prefix}.weight", (FP8_DTYPE,))})
        whole = len(output_partition_sizes) == 1 and rows == output_size and input_size_per_partition == input_size
        # NaN until loaded: a scale block that no checkpoint tensor filled is found after loading
        scale = torch.full((triton.cdiv(rows, bn), triton.cdiv(input_size_per_partition, bk)), float("nan"))
        add_param(layer, self.scale_name, scale,
                  {"input_dim": 1, "output_dim": 0, "group_dims": {0: bn, 1: bk},
                   "weight_loader": block_scale_loader(layer, loader, f"{prefix}.{self.scale_name}", self.block,
                                                       whole)})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        missing = torch.isnan(getattr(layer, self.scale_name).data)
        if missing.any():
            rows = sorted(set(missing.nonzero()[:, 0].tolist()))
            raise ValueError(f"{layer.prefix}.{self.scale_name}: block scales are missing after loading (scale rows "
                             f"{rows[:8]}{' ...' if len(rows) > 8 else ''} of {missing.shape[0]}, each "
                             f"{self.block[0]} weight rows); the checkpoint needs a {self.scale_name} for every "
                             "quantized weight")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fp8_block_linear(x, layer.weight, getattr(layer, self.scale_name), self.block, bias)
