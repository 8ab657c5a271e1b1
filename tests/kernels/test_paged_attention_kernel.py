"""The unified paged-attention kernel against the PyTorch reference (fp32, CPU interpreter or GPU)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.paged_attention import paged_attention, paged_attention_ref
from pagedllm.kernels.split_k import choose_num_splits

# (num_heads, num_kv_heads, head_dim, block_size): GQA 4:1 with a 16-token block; MHA with a
# non-power-of-two head_dim (padded to 128 inside the kernel) and tiny 4-token blocks.
CONFIGS = [(4, 1, 64, 16), (4, 4, 80, 4)]

# Mixed batch: a 40-token prefill chunk over 60 cached tokens (several query tiles when 4 heads
# share a kv head), two decodes, a whole 5-token prompt, and an 18-token chunk. Contexts cross
# several 64-key tiles.
MIXED_Q = [40, 1, 5, 1, 18]
MIXED_S = [100, 37, 5, 130, 40]
DECODE_S = [100, 37, 300]


def _check(query, kv_cache, md, num_splits, atol=1e-4):
    scale = query.shape[-1] ** -0.5
    out = paged_attention(query, kv_cache, md, scale, num_splits=num_splits)
    ref = paged_attention_ref(query, kv_cache, md, scale)
    assert out.shape == query.shape and out.dtype == query.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    return out


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", CONFIGS)
def test_mixed_prefill_and_decode(make_batch, device, num_heads, num_kv_heads, head_dim, block_size):
    md, kv_cache = make_batch(MIXED_Q, MIXED_S, block_size, num_kv_heads, head_dim, device, num_blocks=96)
    # Two CUDA-graph padding rows past num_actual_tokens must come back as zeros.
    query = torch.randn(md.num_actual_tokens + 2, num_heads, head_dim, device=device)
    out = _check(query, kv_cache, md, num_splits=None)
    assert torch.count_nonzero(out[md.num_actual_tokens :]) == 0


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", CONFIGS)
def test_split_k_decode(make_batch, device, num_heads, num_kv_heads, head_dim, block_size):
    # A CUDA-graph style batch: a dummy request (no tokens, empty context) and two padding rows.
    md, kv_cache = make_batch([1, 1, 1, 0], DECODE_S + [0], block_size, num_kv_heads, head_dim, device, 120)
    query = torch.randn(md.num_actual_tokens + 2, num_heads, head_dim, device=device)
    # 4 partitions of the 37-key context leave splits with one tile or none: the empty ones
    # must drop out of the merge.
    for num_splits in (4, 1):
        out = _check(query, kv_cache, md, num_splits=num_splits)
        assert torch.count_nonzero(out[md.num_actual_tokens :]) == 0


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_order_changes_only_the_schedule(make_batch, device, num_splits):
    # Requests started longest first (the CUDA-graph runner's order): same rows, bit for bit.
    md, kv_cache = make_batch([1, 1, 1, 0], DECODE_S + [0], 16, 1, 64, device, 120)
    query = torch.randn(md.num_actual_tokens + 2, 4, 64, device=device)
    plain = _check(query, kv_cache, md, num_splits=num_splits)
    md.decode_order = torch.argsort(md.seq_lens, descending=True, stable=True).to(torch.int32)
    assert md.decode_order.tolist() == [2, 0, 1, 3]
    ordered = _check(query, kv_cache, md, num_splits=num_splits)
    assert torch.equal(ordered, plain)
    if num_splits == 1:
        # The kernel does read the order: pointing every program at request 0 leaves the other
        # requests' rows unattended.
        md.decode_order = torch.zeros(4, dtype=torch.int32, device=device)
        poisoned = paged_attention(query, kv_cache, md, 64 ** -0.5, num_splits=1)
        assert not torch.allclose(poisoned[1:3], plain[1:3])


def test_split_k_mixed_batch(make_batch, device):
    # The split path is written for any batch, not only decodes: partitions follow each query tile.
    md, kv_cache = make_batch(MIXED_Q, MIXED_S, 16, 1, 64, device, num_blocks=96)
    query = torch.randn(md.num_actual_tokens, 4, 64, device=device)
    _check(query, kv_cache, md, num_splits=3)


def test_half_precision(make_batch, device):
    md, kv_cache = make_batch([7, 1], [20, 70], 16, 2, 64, device, dtype=torch.float16)
    query = torch.randn(md.num_actual_tokens, 4, 64, device=device, dtype=torch.float16)
    _check(query, kv_cache, md, num_splits=None, atol=2e-3)


def test_choose_num_splits():
    # Long contexts and too few programs: split, in powers of two.
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=4096) == 16
    assert choose_num_splits(num_reqs=2, num_kv_heads=8, max_query_len=1, max_seq_len=32768) == 64
    assert choose_num_splits(num_reqs=16, num_kv_heads=8, max_query_len=1, max_seq_len=4096) == 8
    assert choose_num_splits(num_reqs=31, num_kv_heads=8, max_query_len=1, max_seq_len=32768) == 4
    # Enough programs already (>= 256 request x kv-head pairs), short contexts, or a batch with
    # prefills: no split.
    assert choose_num_splits(num_reqs=32, num_kv_heads=8, max_query_len=1, max_seq_len=32768) == 1
    assert choose_num_splits(num_reqs=128, num_kv_heads=8, max_query_len=1, max_seq_len=32768) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=300) == 1
    assert choose_num_splits(num_reqs=1, num_kv_heads=8, max_query_len=7, max_seq_len=32768) == 1


def test_rejects_bad_shapes(make_batch, device):
    md, kv_cache = make_batch([1], [5], 16, 2, 64, device)
    with pytest.raises(ValueError, match="do not fit"):
        paged_attention(torch.randn(1, 3, 64, device=device), kv_cache, md, 0.125)
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(torch.randn(1, 4, 64, device=device), kv_cache, md, 0.125, num_splits=0)
