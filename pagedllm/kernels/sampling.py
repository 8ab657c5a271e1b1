"""Fused temperature sampling: one pass over the logits, no softmax, no (R, V) temporaries.

Sampling from softmax(logits / T) is the Gumbel-max trick: token = argmax(logits / T + g) with
g = -log(-log(u)), u ~ U(0, 1) i.i.d. (the same law as the sampler's exponential race,
argmax(p / q) with q = -log(u), taken in log space, where softmax's normaliser cancels).
Greedy rows (T < 1e-5) take argmax(logits). Each row streams its logits once in tiles of
BLOCK_V, drawing u from Philox with (seed, row * V + col), so a step costs one read of the
(R, V) logits instead of the ~6 passes of divide / softmax / uniform / log / divide / argmax.

Used on CUDA for rows with neither top-k, top-p nor min-p nor a per-request seed; everything
else takes the sampler's torch path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GREEDY_EPS = 1e-5


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,
    temperature_ptr,
    out_ptr,
    seed,
    vocab_size,
    stride_row,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    t = tl.load(temperature_ptr + row)
    greedy = t < 1e-5
    inv_t = 1.0 / tl.maximum(t, 1e-5)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_idx = tl.zeros((BLOCK_V,), tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row * stride_row + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * vocab_size + cols)
        # u in [0, 1): clamp away from 0 so -log(u) is finite; u near 1 gives g -> +large, fine.
        u = tl.maximum(u, 1e-20)
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x * inv_t + g)
        score = tl.where(mask, score, float("-inf"))
        better = score > best
        best = tl.where(better, score, best)
        best_idx = tl.where(better, cols, best_idx)
    m = tl.max(best, axis=0)
    # Lowest column among the lanes that hold the maximum (deterministic ties).
    idx = tl.min(tl.where(best == m, best_idx, vocab_size), axis=0)
    tl.store(out_ptr + row, idx.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """logits (R, V), temperature (R,) float32 -> sampled ids (R,) int64 on logits' device."""
    if logits.dim() != 2 or temperature.shape != (logits.shape[0],):
        raise ValueError(f"expected logits (R, V) and temperature (R,), got {tuple(logits.shape)} and "
                         f"{tuple(temperature.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    num_rows, vocab = logits.shape
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    _gumbel_argmax_kernel[(num_rows,)](
        logits, temperature.to(torch.float32), out, seed, vocab, logits.stride(0),
        BLOCK_V=1024, num_warps=4,
    )
    return out


def gumbel_argmax_ref(logits: torch.Tensor, temperature: torch.Tensor, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
    """The same law in plain torch (its own random stream, so equal in distribution, not in draws)."""
    greedy = temperature < _GREEDY_EPS
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_min(1e-20)
    g = -torch.log(-torch.log(u))
    t = torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(1)
    score = torch.where(greedy.unsqueeze(1), logits.float(), logits.float() / t + g)
    return score.argmax(dim=-1)
