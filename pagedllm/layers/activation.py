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
