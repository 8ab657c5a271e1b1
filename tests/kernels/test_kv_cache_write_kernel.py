"""The KV-cache write kernel against `torch_ref.write_kv_cache`: same cache bytes, -1 slots skipped."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.kv_cache_write import write_kv_cache, write_kv_cache_ref


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_matches_reference_and_skips_padding(device, cache_dtype):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 6, 4, 2, 80, 10
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens: must not be written anywhere
    slots = slots.to(device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(cache_dtype)
    before = cache.clone()
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    # Independently of the reference: written slots hold the new rows, all others their old values.
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    valid = slots >= 0
    assert torch.equal(flat[0, slots[valid]], key[valid].to(cache_dtype))
    assert torch.equal(flat[1, slots[valid]], value[valid].to(cache_dtype))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=device)
    untouched[slots[valid]] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, num_kv_heads, head_dim)[:, untouched])


def test_strided_inputs(device):
    # key/value as column slices of a fused qkv projection: rows are not contiguous.
    num_kv_heads, head_dim, num_tokens = 2, 16, 5
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, device=device)
    key = qkv[:, 4 * head_dim : 6 * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, 6 * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.tensor([3, 0, 9, 14, 7], device=device)
    cache = torch.zeros(2, 4, 4, num_kv_heads, head_dim, device=device)
    expected = cache.clone()
    write_kv_cache_ref(key, value, expected, slots)
    write_kv_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_rejects_mismatched_shapes(device):
    cache = torch.zeros(2, 4, 4, 2, 16, device=device)
    with pytest.raises(ValueError, match="key/value"):
        write_kv_cache(torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), cache, torch.arange(3))
