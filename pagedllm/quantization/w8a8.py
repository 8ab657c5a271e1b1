"""The W8A8 linear method shared by `fp8` and compressed-tensors' W8A8-FP8 / W8A8-INT8 schemes.

Parameters a checkpoint fills (names as vLLM / llm-compressor write them):

    weight        (out, in) float8_e4m3fn or int8        input_dim 1, output_dim 0
    weight_scale  (out,) fp32 here; the checkpoint holds one per tensor (() or (1,)) or one per
                  output channel ((out,) or (out, 1)); per-tensor scales of fused q/k/v or gate/up
                  shards become those shards' rows (quantization/utils.output_scale_loader)
    input_scale   static activations only: one scalar per checkpoint tensor; a fused layer uses
                  the largest of its shards' (vLLM does the same), since they share one input

Online FP8 (`quantization="fp8"` on a bf16/fp32 checkpoint): `weight` is created in the model dtype,
loaded as usual, and quantized per output channel in `process_weights_after_loading`
(scale = amax(|row|) / 448), so an 8B model holds 8 GB of FP8 weights after load.

Compute: kernels/scaled_mm.w8a8_linear (per-token dynamic activation scales unless static). On a GPU,
batches of <= 16 rows run weight-only (kernels/w8a16_gemv.py: the activations are not quantized, so a
static input_scale is not applied there either; the result is the dequantized weights' exact product).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.kernels.scaled_mm import (
    DEFER_SCALES,
    FP8_DTYPE,
    FP8_MAX,
    INT8_MAX,
    ensure_unit_scale,
    rowwise_scaled_mm_supported,
    w8a8_linear,
)
from pagedllm.kernels.w8a8_gemm import ensure_workspace
from pagedllm.quantization.base import LinearMethodBase
from pagedllm.quantization.utils import (
    FLOAT_DTYPES,
    add_param,
    checked_loader,
    output_scale_loader,
    shard_scalar_loader,
)


class W8A8LinearMethod(LinearMethodBase):
    """y = dequant(quant(x) @ Wq^T) with fp8 or int8 weights and activations."""

    def __init__(self, qdtype: torch.dtype, static_input: bool, serialized: bool = True) -> None:
        if qdtype not in (FP8_DTYPE, torch.int8):
            raise ValueError(f"W8A8 weights are float8_e4m3fn or int8, not {qdtype}")
        if not serialized and qdtype != FP8_DTYPE:
            raise ValueError("online quantization is built for fp8 only")
        if not serialized and static_input:
            raise ValueError("online fp8 has no calibrated input scales: activation_scheme must be 'dynamic'")
        self.qdtype = qdtype
        self.static_input = static_input
        self.serialized = serialized  # False: the checkpoint holds bf16/fp32 weights (online fp8)

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
        rows = sum(output_partition_sizes)
        prefix = getattr(layer, "prefix", "")
        wdtype = self.qdtype if self.serialized else params_dtype
        accepted = (self.qdtype,) if self.serialized else FLOAT_DTYPES
        add_param(layer, "weight", torch.empty(rows, input_size_per_partition, dtype=wdtype),
                  {"input_dim": 1, "output_dim": 0, **extra_weight_attrs,
                   "weight_loader": checked_loader(loader, f"{prefix}.weight", accepted)})
        if self.serialized:
            add_param(layer, "weight_scale", torch.ones(rows, dtype=torch.float32),
                      {"output_dim": 0, "weight_loader": output_scale_loader(layer, f"{prefix}.weight_scale")})
        if self.static_input:
            add_param(layer, "input_scale", torch.full((len(output_partition_sizes),), float("nan")),
                      {"weight_loader": shard_scalar_loader(layer, f"{prefix}.input_scale")})

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.serialized:
            w = layer.weight.data.float()
            qmax = FP8_MAX if self.qdtype == FP8_DTYPE else INT8_MAX
            scale = (w.abs().amax(dim=1) / qmax).clamp(min=1e-12)
            q = (w / scale[:, None]).clamp(-qmax, qmax).to(self.qdtype)
            del layer.weight
            add_param(layer, "weight", q, {})
            add_param(layer, "weight_scale", scale, {})
        if self.static_input:
            scales = layer.input_scale.data
            if torch.isnan(scales).any():
                raise ValueError(f"{layer.prefix}.input_scale: static activation scales are missing for some "
                                 "shards of this layer")
            layer.input_scale.data = scales.max().reshape(1)
        if layer.weight.is_cuda and self.qdtype == FP8_DTYPE:
            rowwise_scaled_mm_supported(layer.weight.device)  # probed now, before any CUDA-graph capture
        if layer.weight.is_cuda:
            ensure_workspace(layer.weight.device)  # the one-launch split-K's scratch, made before any capture
            if self.qdtype == FP8_DTYPE:
                ensure_unit_scale(layer.weight.device)  # the deferred-scale GEMM's 1.0 (PAGEDLLM_FP8_DEFER_SCALES)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # defer_output_scales: set by a model whose next kernel applies the scales (models/llama.py, with
        # PAGEDLLM_FP8_DEFER_SCALES=1); then the output may be a ScaledOutput (kernels/scaled_mm.py)
        defer = DEFER_SCALES and getattr(layer, "defer_output_scales", False) and getattr(layer, "tp_size", 1) == 1
        return w8a8_linear(x, layer.weight, layer.weight_scale,
                           layer.input_scale if self.static_input else None, bias, defer_scales=defer)
