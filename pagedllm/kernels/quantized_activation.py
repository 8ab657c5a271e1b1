"""`QuantizedActivation`: an activation already quantized for the W8A8 linear it feeds (kernels/scaled_mm.py
takes it, layers/quant_fusion.py makes it). Its own module, without Triton, so the models can name the
type without importing the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedActivation"]


@dataclass(frozen=True)
class QuantizedActivation:
    """An activation quantized by the kernel that produced it (kernels/quant_act.py: rms_norm_quant,
    silu_and_mul_quant) for the W8A8 linear it feeds, which then skips its own quantization launch.
    Dynamic per-token scales, as `scaled_mm.quantize_activation` makes them."""

    xq: torch.Tensor  # (M, K) fp8 / int8
    scale: torch.Tensor  # (M, 1) fp32
    dtype: torch.dtype  # the unquantized activation's dtype: the linear's output dtype

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape

    @property
    def is_cuda(self) -> bool:
        return self.xq.is_cuda
