"""The one-row int4 stream kernel's x prologue (kernels/wna16_stream.py): the GEMV's inputs, either x
itself or the output of the kernel before, computed where the packed path loads x.

The kernel before the GEMV, in its x prologue (the program's max, the pairs), packed path only, so
batch-1 decode saves that kernel's launch:
    SwiGLU's activation (act="silu_and_mul", the down projection): x is the (1, 2K) gate_up row and
    the inputs silu(gate) * up, rounded to x's dtype as `activation.silu_and_mul` stores them;
    residual add + RMSNorm (`wna16_stream_linear_rms_norm`, qkv_proj and gate_up_proj): every program
    sums the squares of the whole row h = x + residual (2 x 8 KB at hidden 4096, from L2) for its
    rstd, its inputs are (h * rstd * w) rounded as `rmsnorm.rms_norm` stores them, and the first N
    block's programs store h (the new residual) for their K ranges.

References: `activation.silu_and_mul` and `rmsnorm.rms_norm` (the values are rounded as they store them).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _x_in(x_ptr, perm_ptr, cols, x_half, r_ptr, nw_ptr, rstd, HAS_PERM: tl.constexpr, X_ACT: tl.constexpr):
    """The GEMV's inputs at `cols` as fp32: x itself (X_ACT 0); (1) x the (1, 2K) gate_up row, gate then
    up: silu(x[c]) * x[x_half + c] rounded to x's dtype once, as `activation.silu_and_mul` stores it;
    (2) residual add + RMSNorm as `rmsnorm.rms_norm` stores them: h = (x + r) rounded to x's dtype,
    then (h * rstd * w) rounded (rstd of the whole row, from `_row_rstd`)."""
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols)
    if X_ACT == 1:
        gate = tl.load(x_ptr + cols).to(tl.float32)
        up = tl.load(x_ptr + x_half + cols).to(tl.float32)
        return (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
    elif X_ACT == 2:
        h = (tl.load(x_ptr + cols).to(tl.float32) + tl.load(r_ptr + cols).to(tl.float32)).to(x_ptr.dtype.element_ty)
        w = tl.load(nw_ptr + cols).to(tl.float32)
        return (h.to(tl.float32) * rstd * w).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        return tl.load(x_ptr + cols).to(tl.float32)


@triton.jit
def _row_rstd(x_ptr, r_ptr, hidden, eps, HIDDEN_PAD: tl.constexpr):
    """rsqrt(mean(h^2) + eps) of the whole row h = (x + r) rounded to x's dtype (`rmsnorm.rms_norm`)."""
    CHUNK: tl.constexpr = min(HIDDEN_PAD, 1024)  # a chunk at a time: registers stay bounded at any width
    ss = tl.zeros([CHUNK], tl.float32)
    for c0 in tl.static_range(0, HIDDEN_PAD, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        m = offs < hidden
        h = (tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
             + tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        ss += h * h
    return tl.rsqrt(tl.sum(ss, 0) / hidden + eps)
