"""`--quantization gguf` on a GPU: Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K linears computed on their blocks.

The loader hands each such layer its raw blocks (`<name>.qweight`, uint8 rows of blocks in HF row
order, as for the CPU kernels: quantization/gguf.py); `process_weights_after_loading` repacks them on
the device into the layout of kernels/gguf_dequant.py and frees the raw bytes. No dense copy of the
weight is kept: a Q4_K_M Llama-3.1-8B's linears take ~4.7 GB instead of 14 GB of bf16.

Decode batches (<= 16 rows) run the GEMV on the blocks; larger steps dequantize into a scratch for
cuBLAS (kernels/gguf_gemv.py). Off CUDA (tests forcing this method on the CPU) `apply` is the fp32
torch reference; the kernels' own interpreter tests call them directly (tests/kernels/test_gguf_kernels.py).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
from torch import nn

from pagedllm.kernels.gguf_dequant import GGUF_BLOCK, GGUFPacked, repack_gguf_rows
from pagedllm.layers.utils import set_weight_attrs
from pagedllm.quantization.base import LinearMethodBase

GPU_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GGUFGPULinearMethod(LinearMethodBase):
    """A linear whose weight stays GGUF blocks (repacked), computed by kernels/gguf_gemv.py."""

    keeps_dense_weight = False  # quantized_weight_names: the loader need not dequantize these tensors

    def __init__(self, qtype: str) -> None:
        if qtype not in GGUF_BLOCK:
            raise ValueError(f"GGUF type {qtype} has no GPU kernel (have {sorted(GGUF_BLOCK)})")
        self.qtype = qtype

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
        if params_dtype not in GPU_ACT_DTYPES:
            raise ValueError(f"GGUF GPU kernels take bfloat16 / float16 / float32 activations, not {params_dtype}")
        qk, nbytes = GGUF_BLOCK[self.qtype]
        k = input_size_per_partition
        if k % qk:
            raise ValueError(f"GGUF {self.qtype} rows need a multiple of {qk} inputs, got {k}")
        # (rows, bytes of one row's blocks), rows in output order: fused shards load by output rows.
        qweight = nn.Parameter(torch.zeros(sum(output_partition_sizes), k // qk * nbytes, dtype=torch.uint8),
                               requires_grad=False)
        # A RowParallelLinear rank takes whole blocks of its inputs (load_slice divides by this Fraction).
        set_weight_attrs(qweight, {"output_dim": 0, "input_dim": 1, "packed_dim": 1,
                                   "pack_factor": Fraction(qk, nbytes)})
        set_weight_attrs(qweight, extra_weight_attrs)
        layer.register_parameter("qweight", qweight)
        layer.gguf_in_features = k

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.gguf_packed = repack_gguf_rows(layer.qweight.data, self.qtype, layer.gguf_in_features)
        del layer.qweight  # the raw blocks are no longer needed

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        packed: GGUFPacked = layer.gguf_packed
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 0:
            return x.new_zeros(*lead, packed.n)
        if x2.is_cuda:
            from pagedllm.kernels.gguf_gemv import gguf_linear

            out = gguf_linear(x2, packed, bias)
        else:
            from pagedllm.kernels.gguf_gemv import gguf_linear_ref

            out = gguf_linear_ref(x2, packed, bias)
        return out.reshape(*lead, packed.n)
