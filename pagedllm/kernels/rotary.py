"""Neox-style rotary embedding, applied in place to q and k (vLLM's `rotary_embedding`, is_neox=True).

Cache layout (same as vLLM's `cos_sin_cache`): a (max_position, rot_dim) tensor; row p holds
cos(p * inv_freq) in its first rot_dim // 2 columns and sin(p * inv_freq) in the last
rot_dim // 2, with inv_freq[i] = base ** (-2i / rot_dim). Example, rot_dim 4:
row p = [cos(p f0), cos(p f1), sin(p f0), sin(p f1)].

Neox style rotates the two halves of the first rot_dim features of every head as pairs
(x[i], x[i + rot_dim // 2]):
    x1' = x1 * cos - x2 * sin,    x2' = x2 * cos + x1 * sin
Features rot_dim..head_size (partial rotary) are left untouched. Math in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["build_cos_sin_cache", "rotary_embedding", "rotary_embedding_ref"]


def build_cos_sin_cache(
    rot_dim: int, max_position: int, base: float = 10000.0, dtype: torch.dtype = torch.float32, device=None
) -> torch.Tensor:
    """Plain RoPE (no scaling) cache in the layout above: (max_position, rot_dim)."""
    if rot_dim % 2:
        raise ValueError(f"rot_dim must be even, got {rot_dim}")
    inv_freq = base ** (-torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    freqs = torch.arange(max_position, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


@triton.jit
def _rotate_heads(
    x_ptr,
    t,
    stride_t,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    # Rotates all heads of token t in place; cos/sin are (HALF_PAD,) fp32.
    h = tl.arange(0, HEADS_PAD)
    i = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < NUM_HEADS) & (i[None, :] < HALF)
    p1 = x_ptr + t * stride_t + h[:, None] * stride_h + i[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(p1, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # (num_tokens,) int32/int64
    q_ptr,  # (num_tokens, num_q_heads, head_size) with unit stride along head_size
    k_ptr,  # (num_tokens, num_k_heads, head_size); only when HAS_KEY
    cache_ptr,  # (max_position, rot_dim): [cos | sin]
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_cache,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_KEY: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + i, mask=i < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_q_t, stride_q_h, cos, sin, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    if HAS_KEY:
        _rotate_heads(k_ptr, t, stride_k_t, stride_k_h, cos, sin, NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def _heads_view(x: torch.Tensor, num_tokens: int, head_size: int, name: str) -> torch.Tensor:
    if x.shape[0] != num_tokens or x.shape[1:].numel() % head_size:
        raise ValueError(
            f"{name} of shape {tuple(x.shape)} is not (num_tokens={num_tokens}, heads * {head_size})"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dim (it is rotated in place)")
    return x.view(num_tokens, -1, head_size)


def rotary_embedding(
    positions: torch.Tensor,  # (num_tokens,) int
    query: torch.Tensor,  # (num_tokens, num_heads * head_size) or (num_tokens, num_heads, head_size)
    key: torch.Tensor | None,  # (num_tokens, num_kv_heads * head_size) or 3-D likewise
    head_size: int,
    cos_sin_cache: torch.Tensor,  # (max_position, rot_dim)
) -> None:
    """Rotate query and key in place (neox style). Positions past the cache are out of bounds:
    the caller guarantees positions < max_position, as vLLM's kernel does."""
    num_tokens = positions.shape[0]
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > head_size:
        raise ValueError(f"cos_sin_cache rot_dim {rot_dim} must be even and <= head_size {head_size}")
    q3 = _heads_view(query, num_tokens, head_size, "query")
    k3 = _heads_view(key, num_tokens, head_size, "key") if key is not None else q3
    if num_tokens == 0:
        return
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = rot_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q3,
        k3,
        cache,
        q3.stride(0),
        q3.stride(1),
        k3.stride(0),
        k3.stride(1),
        cache.stride(0),
        NUM_Q_HEADS=q3.shape[1],
        NUM_K_HEADS=k3.shape[1],
        Q_HEADS_PAD=triton.next_power_of_2(q3.shape[1]),
        K_HEADS_PAD=triton.next_power_of_2(k3.shape[1]),
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        HAS_KEY=key is not None,
        num_warps=4 if q3.shape[1] * half >= 1024 else 1,
    )


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Plain PyTorch twin of `rotary_embedding` (also in place)."""
    rot_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # (T, rot_dim // 2) each
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x in (query, key):
        if x is None:
            continue
        x3 = x.view(x.shape[0], -1, head_size)
        x1, x2 = x3[..., :rot_dim].float().chunk(2, dim=-1)
        x3[..., :rot_dim] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
