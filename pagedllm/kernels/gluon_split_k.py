"""The Gluon int4 kernels' output epilogue (kernels/wna16_wgmma.py, wna16_mma8.py): a transposed tile
acc[n, m] = out[m, n] stored, or, split over K, its fp32 partial summed by the last program of its tile.

Split-K as kernels/gemv.py's `store_split_k_output` in Triton: each program of a tile stores its partial to
the workspace (split s at s * M * N), a block barrier makes every thread's partial written, then one
release-acquire increment of the tile's counter publishes it at GPU scope; the program that arrives last
reads all partials from L2 in split order (the same bits whoever arrives last), adds the bias, writes the
output and resets the counter (no memset between calls).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["block_barrier", "store_transposed_output"]

block_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # the name from Triton 3.7 on


@gluon.jit
def store_transposed_output(acc, out_ptr, ws_ptr, counter_ptr, bias_ptr, tile, pid_k, on, om, M, N, stride_om,
                            SPLIT_K, HAS_BIAS: gl.constexpr, USE_SPLIT: gl.constexpr):
    """acc (BLOCK_N, BLOCK_M) fp32 in any layout, on / om its output columns / rows (slices of that layout):
    out[om, on] = acc (+ bias[on]) in the output's dtype, rows >= M and columns >= N left alone."""
    DTYPE = out_ptr.dtype.element_ty
    n_mask = on < N
    o_mask = n_mask[:, None] & (om < M)[None, :]
    out_ptrs = out_ptr + om.to(gl.int64)[None, :] * stride_om + on[:, None]
    if not USE_SPLIT:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + on, mask=n_mask, other=0.0).to(gl.float32)[:, None]
        gl.store(out_ptrs, acc.to(DTYPE), mask=o_mask)
    else:
        part_ptrs = ws_ptr + (om[None, :] * N + on[:, None])  # split s adds s * M * N
        gl.store(part_ptrs + pid_k * M * N, acc, mask=o_mask)
        block_barrier()
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = gl.zeros_like(acc)
            for part in range(0, SPLIT_K):
                total += gl.load(part_ptrs + part * M * N, mask=o_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                total += gl.load(bias_ptr + on, mask=n_mask, other=0.0).to(gl.float32)[:, None]
            gl.store(out_ptrs, total.to(DTYPE), mask=o_mask)
            gl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call, no memset needed
