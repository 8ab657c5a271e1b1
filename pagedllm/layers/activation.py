"""Activations for gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu.build import load_cpu_kernels


class SiluAndMul(nn.Module):
    """(num_tokens, 2 * d) = [gate | up] -> silu(gate) * up, (num_tokens, d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from pagedllm.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        if x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
            lib = load_cpu_kernels()
            if lib is not None:
                # One pass instead of silu, a temporary and mul (float32 rounding-level differences:
                # the exp is a 2-ulp polynomial).
                out = torch.empty((x.shape[0], d), dtype=x.dtype)
                lib.silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], d)
                return out
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """(num_tokens, 2 * d) = [gate | up] -> gelu(gate) * up (GeGLU: Gemma's gelu_pytorch_tanh is
    approximate="tanh"). Plain torch on every device: elementwise, fused by nothing here yet."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"GeluAndMul approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]
