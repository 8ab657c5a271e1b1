"""`QuantizedActivation`: an activation already quantized for the W8A8 linear it feeds (kernels/scaled_mm.py
takes it, layers/quant_fusion.py makes it), `ScaledOutput`, and the check and torch reference that every
consumer of a ScaledOutput's scales shares. Its own module, without Triton, so the models can name the
types without importing the kernels."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizedActivation", "ScaledOutput", "apply_in_scales", "check_in_scales"]


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


@dataclass(frozen=True)
class ScaledOutput:
    """A W8A8 linear's output with its scales not yet applied (PAGEDLLM_FP8_DEFER_SCALES=1): the GEMM ran with
    unit scales (cuBLASLt's per-tensor FP8 call, the fastest for the narrow decode linears), and the kernel
    that consumes the output applies them (layers/quant_fusion.rms_norm_into: the residual add + RMSNorm);
    y = acc * row_scale * col_scale[None, :], rounded to acc's dtype, is what the linear would have returned
    (kernels/scaled_mm.materialize computes it where a consumer cannot)."""

    acc: torch.Tensor  # (M, N) the unscaled sums, rounded to the activation dtype
    row_scale: torch.Tensor  # (M, 1) fp32: the activation's per-token scales
    col_scale: torch.Tensor  # (N,) fp32: the weight's per-channel scales

    @property
    def shape(self) -> torch.Size:
        return self.acc.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.acc.dtype

    @property
    def is_cuda(self) -> bool:
        return self.acc.is_cuda


def check_in_scales(in_scales: tuple[torch.Tensor, torch.Tensor] | None, m: int, n: int, what: str) -> None:
    """A ScaledOutput's (row_scale, col_scale) as a consumer kernel takes them for an (m, n) acc: row (m, 1),
    col (n,) fp32, the rows contiguous (the kernels index them by row and column); `what` names the consumer."""
    if in_scales is None:
        return
    rs, cs = in_scales
    if rs.numel() != m or cs.shape != (n,) or rs.dtype != torch.float32 or cs.dtype != torch.float32:
        raise ValueError(f"{what}: in_scales must be fp32 ({m}, 1) and ({n},), got {rs.dtype} "
                         f"{tuple(rs.shape)} and {cs.dtype} {tuple(cs.shape)}")
    if m > 1 and rs.stride(0) != 1:
        raise ValueError(f"{what}: in_scales' row scales must be contiguous, got strides {tuple(rs.stride())}")


def apply_in_scales(x: torch.Tensor, in_scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The references' materialize: x * row * col in fp32, rounded to x's dtype (x itself without scales)."""
    if in_scales is None:
        return x
    return (x.float() * in_scales[0].float().reshape(-1, 1) * in_scales[1].float()[None, :]).to(x.dtype)
