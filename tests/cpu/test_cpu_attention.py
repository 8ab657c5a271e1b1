"""CpuAttentionBackend against the torch reference: decode batches (GQA, ragged lengths, several block
and head sizes) agree to float32 rounding and write the same KV cache; steps with a prefill chunk
and the cache-less profiling pass are the reference itself."""

import random

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.torch_ref import paged_attention
from pagedllm.cpu.attention import CpuAttentionBackend


def batch(query_lens, seq_lens, heads, kv_heads, head_dim, block_size, seed=0):
    rng = random.Random(seed)
    free = list(range(4 * sum(-(-s // block_size) for s in seq_lens)))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-s // block_size))] for s in seq_lens]
    md = build_metadata(query_lens, seq_lens, tables, block_size)
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, len(free) + sum(map(len, tables)), block_size, kv_heads, head_dim, generator=g)
    t = sum(query_lens)
    # q, k, v as column slices of one fused projection, as the models hand them over
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g) * 2
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return (q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim), v.view(t, kv_heads, head_dim), cache, md)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size",
    [(9, 3, 64, 16), (4, 2, 16, 4), (8, 8, 128, 16), (4, 1, 32, 1), (40, 2, 64, 32)],
)
def test_decode_matches_reference(cpu_kernels, heads, kv_heads, head_dim, block_size):
    seq_lens = [1, 17, 33, 5, 64, 100]
    q, k, v, cache, md = batch([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, block_size)
    ref_cache, cache_out = cache.clone(), cache.clone()
    ref = paged_attention(q, k, v, ref_cache, md, head_dim**-0.5)
    out = CpuAttentionBackend().forward(q, k, v, cache_out, md, head_dim**-0.5)
    assert torch.equal(cache_out, ref_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_steps_and_profiling_pass_are_the_reference(cpu_kernels):
    q, k, v, cache, md = batch([3, 1, 5], [10, 20, 5], 4, 2, 16, 4)
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
