"""RMSNorm with the fused residual add that the decoder layers chain through."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.cpu.build import load_cpu_kernels


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back to x's dtype.

    forward(x) -> y. forward(x, residual) first adds: s = x + residual, and returns (norm(s), s) —
    the decoder layer carries `s` to the next residual add, so the sum is never materialised twice.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype or torch.get_default_dtype()),
                                   requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:
            # One fused Triton kernel (add + norm) instead of ~8 elementwise launches; x may be an MoE
            # block's unsummed top-k outputs (T, top_k, hidden), summed by the same kernel.
            from pagedllm.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is not None and x.dim() == residual.dim() + 1:  # unsummed parts (kernels/rmsnorm.py)
            x = x.float().sum(dim=-2).to(residual.dtype)
        if x.is_cpu and x.dtype == torch.float32:
            fused = self._forward_cpu(x, residual)
            if fused is not None:
                return fused
        orig_dtype = x.dtype
        x = x.float()
        if residual is not None:
            x = x + residual.float()
            residual = x.to(orig_dtype)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        x = (x * torch.rsqrt(variance + self.variance_epsilon)).to(orig_dtype) * self.weight
        if residual is None:
            return x
        return x, residual

    def _forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """One C call instead of ~10 small ops (float32 (T, hidden) rows); None: not applicable here.

        Same arithmetic as below except the order of the mean's sum (float32 rounding level).
        """
        lib = load_cpu_kernels()
        w = self.weight
        if (lib is None or x.dim() != 2 or x.stride(1) != 1 or w.dtype != torch.float32
                or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                              or residual.stride(1) != 1))):
            return None
        t, hidden = x.shape
        out = torch.empty((t, hidden), dtype=x.dtype)
        res_out = torch.empty((t, hidden), dtype=x.dtype) if residual is not None else None
        lib.rms_norm(
            x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
            residual.stride(0) if residual is not None else 0, res_out.data_ptr() if res_out is not None else None,
            w.data_ptr(), out.data_ptr(), t, hidden, self.variance_epsilon,
        )
        return out if res_out is None else (out, res_out)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: y = x / rms(x) * (1 + w), the product in float32 before the cast back.

    The checkpoint stores w; the parameter holds 1 + w in float32 (its loader adds the 1), so the
    fused RMSNorm kernels above compute Gemma's formula unchanged (they multiply in float32).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps, dtype=torch.float32)
        self.weight.weight_loader = self._load_weight

    @staticmethod
    def _load_weight(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        if param.shape != loaded_weight.shape:
            raise ValueError(f"weight: checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.data.copy_(loaded_weight.float() + 1.0)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda or x.dtype == torch.float32:
            return super().forward(x, residual)
        # Half precision off CUDA: the float32 weight must not promote the output.
        orig_dtype = x.dtype
        xf = x.float()
        if residual is not None:
            xf = xf + residual.float()
            residual = xf.to(orig_dtype)
        y = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon) * self.weight)
        y = y.to(orig_dtype)
        return y if residual is None else (y, residual)
