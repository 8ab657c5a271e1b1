"""The activation quantization of a W8A8 linear, fused into the kernel that produces its input.

A dynamic W8A8 linear (quantization/w8a8.py: fp8 online or serialized, compressed-tensors INT8) on the
GPU quantizes its (M, K) input per token in its own launch (kernels/quant_act.py) before the GEMM.
Where the input comes straight from an RMSNorm (qkv_proj, gate_up_proj) or from SwiGLU's silu_and_mul
(down_proj), the norm or activation kernel quantizes its rows itself (rms_norm_quant,
silu_and_mul_quant) and hands the linear a `scaled_mm.QuantizedActivation`: one launch fewer per
linear, and the 16-bit activation never goes to memory. Same codes and scales as the two launches.

Only where the linear would quantize anyway (`scaled_mm.prequantized_path`: the one-row / few-row
W8A16 kernels take the 16-bit input), and the consumer must use the tensor for that linear alone:
modules say which linear that is with an `input_linear` attribute (LlamaAttention: qkv_proj; LlamaMLP:
gate_up_proj). PAGEDLLM_FUSED_ACT_QUANT=0 turns it off (A/B timings).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.envs import environment_variables
from pagedllm.kernels.quantized_activation import QuantizedActivation, ScaledOutput
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm

__all__ = ["ENABLED", "input_quant_dtype", "rms_norm_into", "silu_and_mul_into"]

ENABLED = environment_variables["PAGEDLLM_FUSED_ACT_QUANT"]()


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether x's device runs the Triton kernels (CUDA; tests also say so for CPU tensors under
    TRITON_INTERPRET=1)."""
    return x.is_cuda


def input_quant_dtype(linear: nn.Module | None, m: int, k: int, on_cuda: bool) -> torch.dtype | None:
    """The dtype to quantize an (m, k) input of `linear` to, or None where it takes the 16-bit input: not
    a dynamic W8A8 linear, not on CUDA, or a path without activation quantization."""
    if not ENABLED or linear is None or not on_cuda:
        return None
    from pagedllm.kernels.scaled_mm import prequantized_path
    from pagedllm.quantization.w8a8 import W8A8LinearMethod

    method = getattr(linear, "quant_method", None)
    if not isinstance(method, W8A8LinearMethod) or method.static_input:
        return None
    n, wk = linear.weight.shape
    if k != wk or not prequantized_path(m, n, k, method.qdtype):
        return None
    return method.qdtype


def rms_norm_into(norm: nn.Module, x: torch.Tensor | ScaledOutput, residual: torch.Tensor | None,
                  linear: nn.Module | None
                  ) -> torch.Tensor | QuantizedActivation | tuple[torch.Tensor | QuantizedActivation, torch.Tensor]:
    """norm(x) or norm(x, residual) (the same return convention) for an input of `linear`: quantized
    for it in the norm's kernel where `input_quant_dtype` says so. x a `ScaledOutput` (an FP8 linear that
    left its scales to this norm, PAGEDLLM_FP8_DEFER_SCALES=1): the scales applied in the same kernel, or
    by `scaled_mm.materialize` first where the norm is not fused."""
    in_scales = None
    if isinstance(x, ScaledOutput):
        in_scales, x = (x.row_scale, x.col_scale), x.acc
    qdtype = None
    if type(norm) is RMSNorm and x.dim() == 2 and (residual is None or residual.shape == x.shape):
        qdtype = input_quant_dtype(linear, x.shape[0], x.shape[1], _kernel_device(x))
    if qdtype is None:
        x = _materialized(x, in_scales)
        return norm(x) if residual is None else norm(x, residual)
    from pagedllm.kernels.quant_act import rms_norm_quant

    x2 = x if x.stride(1) == 1 else x.contiguous()
    r2 = residual if residual is None or residual.stride(1) == 1 else residual.contiguous()
    xq, scale, r_out = rms_norm_quant(x2, norm.weight, norm.variance_epsilon, qdtype, r2, in_scales=in_scales)
    out = QuantizedActivation(xq, scale, x.dtype)
    return out if residual is None else (out, r_out)


def silu_and_mul_into(act: nn.Module, x: torch.Tensor | ScaledOutput, linear: nn.Module | None
                      ) -> torch.Tensor | QuantizedActivation:
    """act(x) for an input of `linear` (SwiGLU's down_proj): quantized for it in the activation's kernel
    where `input_quant_dtype` says so. x a `ScaledOutput` (an FP8 gate_up_proj that left its scales to this
    activation, PAGEDLLM_FP8_DEFER_SCALES=1): the scales applied in the same kernel, or by
    `scaled_mm.materialize` first where the activation is not fused."""
    in_scales = None
    if isinstance(x, ScaledOutput):
        in_scales, x = (x.row_scale, x.col_scale), x.acc
    qdtype = None
    if type(act) is SiluAndMul and x.dim() == 2 and x.shape[1] % 2 == 0:
        qdtype = input_quant_dtype(linear, x.shape[0], x.shape[1] // 2, _kernel_device(x))
    if qdtype is None:
        return act(_materialized(x, in_scales))
    from pagedllm.kernels.quant_act import silu_and_mul_quant

    xq, scale = silu_and_mul_quant(x if x.stride(1) == 1 else x.contiguous(), qdtype, in_scales=in_scales)
    return QuantizedActivation(xq, scale, x.dtype)


def _materialized(acc: torch.Tensor, in_scales: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """acc itself, or with a ScaledOutput's scales applied (`scaled_mm.materialize`) for an unfused consumer."""
    if in_scales is None:
        return acc
    from pagedllm.kernels.scaled_mm import materialize

    return materialize(ScaledOutput(acc, *in_scales))
