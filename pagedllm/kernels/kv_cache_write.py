"""Write this step's keys and values into the paged KV cache (vLLM's `reshape_and_cache_flash`).

Token t goes to slot s = slot_mapping[t] = block_id * block_size + offset, i.e. to
kv_cache[0 or 1, block_id, offset, :, :]; s == -1 marks a padding token that is not written.
Reference: `pagedllm.attention.torch_ref.write_kv_cache` (re-exported here as `write_kv_cache_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.attention.torch_ref import write_kv_cache as write_kv_cache_ref


@triton.jit
def to_cache(x, cache_ptr):
    """x cast to the cache's element type. An fp8 (e4m3, kv_cache_dtype "fp8") cache saturates at
    +-448 first, as torch's cast does (the reference), instead of relying on the conversion's overflow."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
    return x.to(cache_ptr.dtype.element_ty)

__all__ = ["write_kv_cache", "write_kv_cache_ref"]


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,  # (num_tokens, num_kv_heads, head_dim)
    value_ptr,  # (num_tokens, num_kv_heads, head_dim)
    k_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    v_cache_ptr,  # (num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping_ptr,  # int64 (num_tokens,)
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_c_blk,
    stride_c_slot,
    stride_c_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per token: copies its (num_kv_heads, head_dim) key and value tiles.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
    dst = blk * stride_c_blk + off * stride_c_slot + h[:, None] * stride_c_h + d[None, :]
    k = tl.load(key_ptr + t * stride_k_t + h[:, None] * stride_k_h + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, to_cache(k, k_cache_ptr), mask=mask)
    v = tl.load(value_ptr + t * stride_v_t + h[:, None] * stride_v_h + d[None, :], mask=mask)
    tl.store(v_cache_ptr + dst, to_cache(v, v_cache_ptr), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), -1 = skip
) -> None:
    """Scatter key/value rows into `kv_cache` in place; same contract as `write_kv_cache_ref`.

    No host sync: the -1 test happens inside the kernel, so the launch is CUDA-graph capturable.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be (2, num_blocks, block_size, heads, head_dim), got {tuple(kv_cache.shape)}"
        )
    num_tokens = slot_mapping.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(
            f"key/value must be ({num_tokens}, {num_kv_heads}, {head_dim}), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    if k_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous along head_dim")
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
    )
