"""The one place a grammar bitmask meets the logits: disallowed tokens get -inf, on the logits' device.

    GrammarOutput(structured_output_request_ids=["b"], grammar_bitmask=int32 (1, ceil(V / 32)))
    rows of the batch ["a", "b", "c"] -> only row 1 is masked; "a" and "c" are untouched.

The bitmask is filled on the host (manager.py) while the device runs the step's forward pass, then
copied with one pinned, non-blocking copy and applied on the device: bit j of word w allows token
32 * w + j. Words past the vocabulary's end are ignored. On CUDA one Triton launch masks the rows in
place (kernels/grammar_bitmask.py); elsewhere `apply_grammar_bitmask_ref`, its reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedllm.host_copy import host_tensor, to_device_async


@dataclass
class GrammarOutput:
    """vLLM's name: the bitmask rows of one step, one per constrained request that samples."""

    structured_output_request_ids: list[str]
    grammar_bitmask: torch.Tensor  # int32 (k, ceil(vocab_size / 32)), on the host


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 (k, W) -> bool (k, vocab_size), True where allowed. [[0b101]] (V=3) -> [[True, False, True]]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # (k, W, 32); arithmetic shift, the & keeps one bit
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Mask rows `rows` of (R, V) logits with the host bitmask (k, W), k == len(rows). In place."""
    if not rows:
        return logits
    if logits.is_cuda and logits.stride(1) == 1:
        from pagedllm.kernels.grammar_bitmask import apply_bitmask_inplace

        mask = to_device_async(bitmask, logits.device)
        first_rows = rows[-1] == len(rows) - 1 and rows == list(range(len(rows)))
        idx = None if first_rows else host_tensor(rows, torch.int32, logits.device)
        return apply_bitmask_inplace(logits, mask, idx)
    if logits.device.type == "cpu":
        return apply_grammar_bitmask_lut(logits, bitmask, rows)
    return apply_grammar_bitmask_ref(logits, bitmask, rows)


@functools.cache
def _byte_penalties(dtype: torch.dtype) -> torch.Tensor:
    """(256, 8): row b holds 0 where bit i of byte b is set (allowed), -inf where not."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype)


def apply_grammar_bitmask_lut(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The CPU path, as `apply_grammar_bitmask_ref` does it (the same result), in two passes: each
    bitmask byte looks up its 8 penalties (0 allowed, -inf not: an embedding lookup) and the rows
    add them. Little-endian words, so byte 4w + j // 8, bit j % 8 is token 32w + j: the lookup's
    (byte, bit) order is the vocabulary's. Several times faster than the reference's (k, W, 32)
    shifts, bool mask and scattered masked_fill (BENCHMARKS.md, issue 22, h48)."""
    if not rows:
        return logits
    k, vocab_size = bitmask.shape[0], logits.shape[1]
    table = _byte_penalties(logits.dtype)
    byte_ids = bitmask.contiguous().view(torch.uint8).view(k, -1).long()  # (k, 4W)
    penalty = torch.nn.functional.embedding(byte_ids, table).view(k, -1)[:, :vocab_size]
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.add_(penalty)
    idx = host_tensor(rows, torch.int64, logits.device)
    return logits.index_copy_(0, idx, logits.index_select(0, idx).add_(penalty))


def apply_grammar_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The torch path (any device): unpack to a bool (k, V) mask, then masked_fill the rows."""
    if not rows:
        return logits
    vocab_size = logits.shape[1]
    mask = to_device_async(bitmask, logits.device)
    allowed = unpack_bitmask(mask, vocab_size)  # (k, V)
    if len(rows) == logits.shape[0] and rows == list(range(len(rows))):
        return logits.masked_fill_(~allowed, float("-inf"))
    idx = host_tensor(rows, torch.int64, logits.device)
    sub = logits.index_select(0, idx).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, idx, sub)
