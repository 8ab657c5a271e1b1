"""Grammar bitmask applied to the logits in place, one launch: disallowed tokens get -inf.

    bitmask int32 (k, W), W = ceil(V / 32): bit j of word w allows token 32 * w + j
    rows    int32 (k,): the logits row that bitmask row i masks; None: row i (the common case of
            every row constrained, which then needs no index copy)
    logits  (R, V), R >= k; rows not named are untouched

The torch path (structured_output/bitmask.py: unpack to a (k, V) bool mask, masked_fill, and an
index_select / index_copy when the rows are not the first k) is the reference: 5-7 launches and a
(k, W, 32) int32 temporary (12.6 MB at 64 rows of a 49k vocabulary). Here the grid is (k, V /
BLOCK_V) programs; each reads BLOCK_V / 32 words and writes only the columns its row forbids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 2048  # columns per program: 64 words of the bitmask


@triton.jit
def _apply_bitmask_kernel(logits_ptr, logits_stride, bitmask_ptr, bitmask_stride, rows_ptr, vocab_size,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab_size
    words = tl.load(bitmask_ptr + i * bitmask_stride + cols // 32, mask=in_vocab, other=-1)
    allowed = ((words >> (cols % 32)) & 1) != 0
    neg_inf = tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride + cols, neg_inf, mask=in_vocab & ~allowed)


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """logits (R, V) with unit column stride, bitmask int32 (k, W) and rows int32 (k,) or None on its device."""
    k, vocab_size = bitmask.shape[0], logits.shape[1]
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and (rows is None or rows.shape == (k,))
    assert k <= logits.shape[0]
    assert bitmask.shape[1] * 32 >= vocab_size, (bitmask.shape, vocab_size)
    if k:
        grid = (k, triton.cdiv(vocab_size, BLOCK_V))
        _apply_bitmask_kernel[grid](logits, logits.stride(0), bitmask, bitmask.stride(0),
                                    bitmask if rows is None else rows, vocab_size,  # unread when None
                                    HAS_ROWS=rows is not None, BLOCK=BLOCK_V)
    return logits
