"""A dense layer with its epilogue: y = x W^T + b, then GELU or + residual, in place on y.

Why plain torch (MKL's sgemm on the CPU) and not oneDNN with prepared weights and fused post-ops:
measured on this project's AVX2 CPU for MiniLM's shapes (BENCHMARKS.md, embeddings), oneDNN's GEMM
took 10-20% more CPU than MKL's, and its fused erf-GELU post-op made the 384 -> 1536 layer ~40%
slower than the same GEMM followed by a separate GELU pass. The epilogue runs in place on the GEMM's
own output buffer, so it costs one pass and no allocation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None = None,
          residual: torch.Tensor | None = None) -> torch.Tensor:
    """act: None, "gelu" (erf) or "gelu_tanh". (T, in) -> (T, out)."""
    y = F.linear(x, weight, bias)
    if act is not None:
        torch.ops.aten.gelu_(y, approximate="tanh" if act == "gelu_tanh" else "none")
    if residual is not None:
        y += residual
    return y


def dense_into(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """residual += x W^T + b, in place, and returned: for a residual the caller no longer needs.
    The GEMM accumulates into it (beta = 1), so the output needs no buffer, no bias copy and no
    separate add pass. (T, in) -> (T, out)."""
    if bias is not None:
        residual += bias
    return residual.addmm_(x, weight.t())
