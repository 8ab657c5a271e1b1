"""CpuAttentionBackend against the torch reference: decode batches (GQA, ragged lengths, several block
and head sizes; float32, float16 and bfloat16 caches) and steps with prefill chunks agree to float32
rounding and write the same KV cache bit for bit; chunks past MAX_C_QUERY_LEN and the cache-less
profiling pass are the reference itself."""

import random

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.torch_ref import paged_attention
from pagedllm.cpu.attention import MAX_C_QUERY_LEN, CpuAttentionBackend


def batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed=0, kv_dtype=torch.float32):
    rng = random.Random(seed)
    free = list(range(4 * sum(-(-s // block_size) for s in seq_lens)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    md = build_metadata(query_lens, seq_lens, tables, block_size)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, len(free) + sum(map(len, tables)), block_size, kv_heads, head_dim, generator=g)
    cache = cache.to(kv_dtype)
    t = sum(query_lens)
    # q, k, v as column slices of one fused projection, as the models hand them over
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g) * 2
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim), cache, md)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 2, 16, 4), (8, 8, 128, 16), (4, 1, 32, 1), (40, 2, 64, 32)],
)
def test_decode_matches_reference(cpu_kernels, heads, kv_heads, head_dim, block_size, kv_dtype):
    seq_lens = [1, 17, 33, 5, 64, 100]
    q, k, v, cache, md = batch([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, block_size, kv_dtype=kv_dtype)
    ref_cache, cache_out = cache.clone(), cache.clone()
    ref = paged_attention(q, k, v, ref_cache, md, head_dim**-0.5)
    out = CpuAttentionBackend().forward(q, k, v, cache_out, md, head_dim**-0.5)
    assert torch.equal(cache_out, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=str)
def test_prefill_chunks_match_reference(cpu_kernels, kv_dtype):
    # Prefill chunks (new prompt tokens on top of cached ones, and whole prompts) beside decodes.
    q, k, v, cache, md = batch([3, 1, 5, 17], [10, 20, 5, 40], 9, 3, 64, 16, kv_dtype=kv_dtype)
    ref_cache, cache_out = cache.clone(), cache.clone()
    ref = paged_attention(q, k, v, ref_cache, md, 0.125)
    out = CpuAttentionBackend().forward(q, k, v, cache_out, md, 0.125)
    assert torch.equal(cache_out, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_long_chunks_and_profiling_pass_are_the_reference(cpu_kernels):
    q, k, v, cache, md = batch([MAX_C_QUERY_LEN + 1, 1], [MAX_C_QUERY_LEN + 1, 9], 4, 2, 16, 16)
    ref_cache, cache_out = cache.clone(), cache.clone()
    ref = paged_attention(q, k, v, ref_cache, md, 0.25)
    assert torch.equal(CpuAttentionBackend().forward(q, k, v, cache_out, md, 0.25), ref)
    assert torch.equal(cache_out, ref_cache)
    assert torch.equal(CpuAttentionBackend().forward(q, k, v, None, md, 0.25), paged_attention(q, k, v, None, md, 0.25))


def test_padding_slots_are_not_written(cpu_kernels):
    q, k, v, cache, md = batch([1, 1], [7, 9], 4, 2, 16, 4)
    md.slot_mapping[1] = -1  # a padded row: its K/V must not land anywhere
    before = cache.clone()
    CpuAttentionBackend().forward(q, k, v, cache, md, 0.25)
    changed = (cache != before).flatten(2).any(-1)  # (2, slots)
    assert int(changed.sum()) == 2  # one slot written, for K and for V


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16bit_cache_write_rounds_as_torch(cpu_kernels, kv_dtype):
    # Ties, values past float16's range, subnormals, zeros, infinities: the kernel's rounding is torch's.
    q, k, v, cache, md = batch([1] * 4, [3, 9, 2, 16], 4, 2, 16, 4, kv_dtype=kv_dtype)
    info = torch.finfo(kv_dtype)
    special = torch.tensor([0.0, -0.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8,
                            65504.0, 65519.0, 65520.0, 1e6, -1e6, float("inf"), float("-inf"), 2.0**-20, -(2.0**-24),
                            2.0**-25, 3 * 2.0**-26, info.tiny, info.tiny / 3, 1e-40, 123.456, -7.77])
    k[0].view(-1)[: special.numel()] = special  # token 0's row of the fused projection
    v[3].view(-1)[: special.numel()] = special.flip(0)
    ref_cache, cache_out = cache.clone(), cache.clone()
    paged_attention(q, k, v, ref_cache, md, 0.25)
    CpuAttentionBackend().forward(q, k, v, cache_out, md, 0.25)
    assert torch.equal(cache_out.view(torch.int16), ref_cache.view(torch.int16))
