"""The combine step of fused MoE: each token's top_k expert outputs summed, one Triton launch.

Reference: `down.view(T, top_k, -1).sum(1)` (which `moe_sum` also runs for strided input).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_sum"]


@triton.jit
def _moe_sum_kernel(
    x_ptr,  # (T, TOP_K, hidden), rows contiguous
    out_ptr,  # (T, hidden)
    hidden,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = sum over the top_k rows of x[t], in fp32, rounded once (as torch's sum of a 16-bit
    tensor)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + k) * hidden + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum(down: torch.Tensor, top_k: int) -> torch.Tensor:
    """(T * top_k, hidden) -> (T, hidden): each token's top_k expert outputs summed. One program per
    (token, 1024 columns): torch's strided reduction over dim 1 ran at ~1.3 TB/s on the H200 at
    decode sizes (7 us a layer at 256 tokens x 8 x 2048). Reference: `down.view(T, top_k, -1).sum(1)`."""
    rows, hidden = down.shape
    t = rows // top_k
    if down.stride(1) != 1 or down.stride(0) != hidden:
        return down.view(t, top_k, hidden).sum(dim=1)
    out = torch.empty((t, hidden), dtype=down.dtype, device=down.device)
    block = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(t, triton.cdiv(hidden, block))](down, out, hidden, TOP_K=top_k, BLOCK=block, num_warps=4)
    return out
