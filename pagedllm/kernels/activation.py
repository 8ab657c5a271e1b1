"""SwiGLU's gate: silu_and_mul over (..., 2 * I) -> (..., I), i.e. silu(x[..., :I]) * x[..., I:].

The MLP's fused gate_up projection yields [gate | up] per token; this computes
silu(gate) * up in fp32 with one rounding to the output dtype (vLLM's `SiluAndMul`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

__all__ = ["silu_and_mul", "silu_and_mul_ref"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # (rows, 2 * inter)
    out_ptr,  # (rows, inter)
    stride_x,
    stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    # Grid (rows, cdiv(inter, BLOCK)): each program does BLOCK columns of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """(..., 2 * I) -> (..., I)."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim must be even (gate and up halves), got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(_BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block >= 512 else 1
        )
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch twin of `silu_and_mul`."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
