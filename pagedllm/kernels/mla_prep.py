"""MLA's per-token prep in one Triton kernel: latent norm, both rotaries, the cache write, the query's rope part.

Before the attention proper, every MLA layer (DeepSeek V2/V3, attention/mla.py) did, per step, on CUDA:
    kv_c = RMSNorm(latent[:, :R])                    1 kernel (a new (T, R) tensor)
    rotary(q_pe, k_pe) in place                      1 kernel
    latent = cat([kv_c, k_pe])                       1 kernel (a new (T, R + P) tensor)
    write_latents(latent, cache, slot_mapping)       1 kernel
    query[..., R:] = q_pe                            1 copy (the absorbed query [q_lat | q_pe])
This kernel does all five in one pass over each token, one program per token:
    latent[t, :R] <- RMSNorm(latent[t, :R]) * w       in place: `latent` is then [kv_c | k_pe] itself
    latent[t, R:] <- rope(latent[t, R:], pos[t])      neox pairs (x[i], x[i + P/2]), as kernels/rotary.py
    q_out[t, h]   <- rope(q_pe[t, h], pos[t])         every head; q_pe (the q_proj output's view) is not modified
    cache[slot[t]] <- latent[t]                       when slot[t] >= 0 and t < num_write
Numerics equal the unfused kernels': the norm as kernels/rmsnorm.py (fp32, x * rstd * w, rounded once),
the rotary as kernels/rotary.py (fp32 from the rounded inputs, rounded once), the cache row a copy.

Reference: `mla_prep_ref` (plain torch, the same five steps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["mla_prep", "mla_prep_ref"]


@triton.jit
def _mla_prep_kernel(
    positions_ptr,  # (T,) int
    q_pe_ptr,  # (T, H, P) strided, read only
    q_out_ptr,  # (T, H, P) strided, written
    latent_ptr,  # (T, R + P), rows of stride stride_lat, unit stride inside; in place
    norm_w_ptr,  # (R,)
    cos_sin_ptr,  # (max_position, P): [cos | sin]
    cache_ptr,  # (num_slots, R + P) rows of stride stride_cache
    slot_ptr,  # (>= num_write,) int: cache slot of each token, -1 = skip
    num_write,
    eps,
    stride_qp_t,
    stride_qp_h,
    stride_qo_t,
    stride_qo_h,
    stride_lat,
    stride_cos,
    stride_cache,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    WRITE_CACHE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    i_mask = i < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + i, mask=i_mask, other=0.0).to(tl.float32)

    # The query's rope part, every head: read from q_pe, written to q_out.
    h = tl.arange(0, H_PAD)
    qm = (h[:, None] < H) & i_mask[None, :]
    src = q_pe_ptr + t * stride_qp_t + h[:, None] * stride_qp_h + i[None, :]
    x1 = tl.load(src, mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=qm, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * stride_qo_t + h[:, None] * stride_qo_h + i[None, :]
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(q_out_ptr.dtype.element_ty), mask=qm)

    # The latent: RMSNorm of c_kv, rope of k_pe, in place.
    row = latent_ptr + t * stride_lat
    offs_r = tl.arange(0, R_PAD)
    r_mask = offs_r < R
    c = tl.load(row + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(c * c, 0) / R + eps)
    w = tl.load(norm_w_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    c_out = (c * rstd * w).to(latent_ptr.dtype.element_ty)
    tl.store(row + offs_r, c_out, mask=r_mask)
    k1 = tl.load(row + R + i, mask=i_mask, other=0.0).to(tl.float32)
    k2 = tl.load(row + R + HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    k1_out = (k1 * cos - k2 * sin).to(latent_ptr.dtype.element_ty)
    k2_out = (k2 * cos + k1 * sin).to(latent_ptr.dtype.element_ty)
    tl.store(row + R + i, k1_out, mask=i_mask)
    tl.store(row + R + HALF + i, k2_out, mask=i_mask)

    if WRITE_CACHE:
        if t < num_write:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            if slot >= 0:
                crow = cache_ptr + slot * stride_cache
                tl.store(crow + offs_r, c_out.to(cache_ptr.dtype.element_ty), mask=r_mask)
                tl.store(crow + R + i, k1_out.to(cache_ptr.dtype.element_ty), mask=i_mask)
                tl.store(crow + R + HALF + i, k2_out.to(cache_ptr.dtype.element_ty), mask=i_mask)


def _check(positions: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor, latent: torch.Tensor,
           norm_weight: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[int, int]:
    t, _, p = q_pe.shape
    r = latent.shape[1] - p
    if q_out.shape != q_pe.shape or positions.shape != (t,) or latent.shape[0] != t or r <= 0:
        raise ValueError(f"mla_prep: q_pe {tuple(q_pe.shape)}, q_out {tuple(q_out.shape)}, latent "
                         f"{tuple(latent.shape)} and positions {tuple(positions.shape)} do not agree")
    if norm_weight.shape != (r,) or cos_sin_cache.shape[-1] != p or p % 2:
        raise ValueError(f"mla_prep: norm weight {tuple(norm_weight.shape)} must be ({r},) and the rotary "
                         f"cache's width {cos_sin_cache.shape[-1]} the (even) rope width {p}")
    if q_pe.stride(2) != 1 or q_out.stride(2) != 1 or latent.stride(1) != 1:
        raise ValueError("mla_prep needs unit stride along the features of q_pe, q_out and latent")
    return r, p


def mla_prep(
    positions: torch.Tensor,  # (T,) int
    q_pe: torch.Tensor,  # (T, H, P): q_proj's rope part (a strided view), not modified
    q_out: torch.Tensor,  # (T, H, P): the rotated q_pe is written here (the absorbed query's last P features)
    latent: torch.Tensor,  # (T, R + P): kv_a_proj_with_mqa's output; normed and rotated in place
    norm_weight: torch.Tensor,  # (R,): kv_a_layernorm's weight
    eps: float,
    cos_sin_cache: torch.Tensor,  # (max_position, P): [cos | sin] (layers/rotary_embedding.py)
    cache: torch.Tensor | None = None,  # (1, num_blocks, block_size, 1, R + P): the layer's latent cache
    slot_mapping: torch.Tensor | None = None,  # (>= num_write,) int, -1 = skip
    num_write: int = 0,  # tokens 0 .. num_write - 1 are written to the cache
) -> None:
    r, p = _check(positions, q_pe, q_out, latent, norm_weight, cos_sin_cache)
    t, h = q_pe.shape[0], q_pe.shape[1]
    if t == 0:
        return
    write = cache is not None and num_write > 0
    flat = cache.view(-1, cache.shape[-1]) if write else latent
    if write and (flat.shape[-1] != r + p or slot_mapping is None):
        raise ValueError(f"mla_prep: cache rows of {flat.shape[-1]} features for latents of {r + p}")
    cos_sin = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = p // 2
    _mla_prep_kernel[(t,)](
        positions, q_pe, q_out, latent, norm_weight, cos_sin, flat, slot_mapping if write else positions,
        num_write if write else 0, float(eps),
        q_pe.stride(0), q_pe.stride(1), q_out.stride(0), q_out.stride(1), latent.stride(0), cos_sin.stride(0),
        flat.stride(0),
        R=r, R_PAD=triton.next_power_of_2(r), HALF=half, HALF_PAD=triton.next_power_of_2(half),
        H=h, H_PAD=triton.next_power_of_2(h), WRITE_CACHE=write,
        num_warps=4 if r >= 256 or h * half >= 1024 else 1,
    )


def mla_prep_ref(
    positions: torch.Tensor, q_pe: torch.Tensor, q_out: torch.Tensor, latent: torch.Tensor,
    norm_weight: torch.Tensor, eps: float, cos_sin_cache: torch.Tensor, cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None, num_write: int = 0,
) -> None:
    """Plain torch of `mla_prep`: the same five steps, the same fp32 math and roundings."""
    r, p = _check(positions, q_pe, q_out, latent, norm_weight, cos_sin_cache)
    half = p // 2
    cs = cos_sin_cache[positions.long()].float()  # (T, P)
    cos, sin = cs[:, :half], cs[:, half:]

    def rope(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    q_out.copy_(rope(q_pe, cos[:, None], sin[:, None]).to(q_out.dtype))
    c = latent[:, :r].float()
    rstd = torch.rsqrt(c.pow(2).sum(-1, keepdim=True) / r + eps)
    latent[:, :r] = (c * rstd * norm_weight.float()).to(latent.dtype)
    latent[:, r:] = rope(latent[:, r:], cos, sin).to(latent.dtype)
    if cache is not None and num_write > 0:
        flat = cache.view(-1, cache.shape[-1])
        slots = slot_mapping[:num_write].long()
        keep = slots >= 0
        flat.index_copy_(0, slots[keep], latent[:num_write][keep].to(flat.dtype))
