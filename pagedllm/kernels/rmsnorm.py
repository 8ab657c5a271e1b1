"""Fused (residual add +) RMSNorm: out = x * rsqrt(mean(x^2) + eps) * w, computed in fp32.

With a residual (vLLM's `fused_add_rms_norm`), x is first replaced by x + residual, rounded to the
input dtype as an unfused model would store it; that sum is both normalised and returned as the
new residual. Works on any (..., hidden) tensor, e.g. Qwen3's per-head q/k norm on
(tokens, heads, head_dim) with hidden = head_dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["is_unsummed_parts", "rms_norm", "rms_norm_ref"]

_MAX_HIDDEN = 65536  # one program holds a whole row in registers


@triton.jit
def add_residual_rms_norm(x, row, cols, mask, residual_ptr, residual_out_ptr, weight_ptr, stride_r, stride_ro,
                          hidden, eps, HAS_RESIDUAL: tl.constexpr):
    """One row's (residual add +) RMSNorm in fp32, the part `_rms_norm_kernel` and the norm + quantize
    kernel (kernels/quant_act.py) share: x (BLOCK,) fp32 -> x * rsqrt(mean(x^2) + eps) * w (fp32,
    unrounded). HAS_RESIDUAL: x + residual[row] is rounded to the residual's dtype, stored as the new
    residual and normalised instead."""
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * rstd * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # (rows, hidden)
    residual_ptr,  # (rows, hidden); only read when HAS_RESIDUAL
    weight_ptr,  # (hidden,)
    out_ptr,  # (rows, hidden)
    residual_out_ptr,  # (rows, hidden); only written when HAS_RESIDUAL
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTS: tl.constexpr = 1,  # x holds PARTS rows per output row, summed first (an MoE's top-k outputs)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    if PARTS == 1:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    else:  # the sum in fp32, rounded to x's dtype as a separate sum kernel would store it
        x = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(PARTS):
            x += tl.load(x_ptr + (row * PARTS + j) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = add_residual_rms_norm(x, row, cols, mask, residual_ptr, residual_out_ptr, weight_ptr, stride_r, stride_ro,
                              hidden, eps, HAS_RESIDUAL)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    # (..., hidden) -> (rows, hidden) with unit stride along hidden; a view whenever possible.
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor,  # (..., hidden)
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    residual: torch.Tensor | None = None,  # (..., hidden), same shape as x, or x's without its dim -2
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x; with a residual returns (normed, x + residual). Inputs are not modified.

    x of shape (T, P, hidden) with a residual of (T, hidden): x's P parts per row are summed first
    (in fp32, rounded to x's dtype), e.g. an MoE block's top-k expert outputs left unsummed, so the
    sum costs no kernel of its own (`is_unsummed_parts`)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    parts = 1
    if residual is not None and is_unsummed_parts(x, residual):
        parts = x.shape[-2]
        if not x.is_contiguous():
            x = x.contiguous()
    elif residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} exceeds the kernel's limit {_MAX_HIDDEN}")
    x2 = _rows(x, hidden)
    has_residual = residual is not None
    r2 = _rows(residual, hidden) if has_residual else x2
    out = torch.empty_like(r2)
    r_out = torch.empty_like(r2) if has_residual else out
    rows = r2.shape[0]
    if rows > 0:
        block_n = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            r_out,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            r_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=has_residual,
            BLOCK_N=block_n,
            PARTS=parts,
            num_warps=min(16, max(1, block_n // 512)),
        )
    if has_residual:
        return out.view(residual.shape), r_out.view(residual.shape)
    return out.view(x.shape)


def is_unsummed_parts(x: torch.Tensor, residual: torch.Tensor) -> bool:
    """x (T, P, hidden) against a residual (T, hidden): P parts of each row, to be summed first."""
    return x.dim() == residual.dim() + 1 and x.shape[:-2] == residual.shape[:-1] and x.shape[-1] == residual.shape[-1]


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch twin of `rms_norm`."""
    if residual is not None and is_unsummed_parts(x, residual):
        x = x.float().sum(dim=-2).to(x.dtype)
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)
    return (out, x) if residual is not None else out
