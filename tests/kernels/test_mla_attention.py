"""MLA over the latent cache: the Triton backend's forward_mla (interpreter on CPU) equals the torch
reference, and the reference's absorbed form equals attention with the heads expanded."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.mla import mla_attention_ref
from pagedllm.attention.triton_backend import TritonAttentionBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
R, ROPE, H, NOPE, V = 32, 8, 4, 16, 24


def _batch(q_lens, s_lens, block_size=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    tables, nxt = [], 0
    for s in s_lens:
        n = -(-s // block_size)
        tables.append(list(range(nxt, nxt + n))[::-1])  # non-contiguous, reversed blocks
        nxt += n
    md = build_metadata(q_lens, s_lens, tables, block_size, device=DEVICE)
    cache = torch.randn(1, nxt, block_size, 1, R + ROPE, generator=g).to(DEVICE)
    query = torch.randn(sum(q_lens), H, R + ROPE, generator=g).to(DEVICE)
    return md, cache, query


@pytest.mark.parametrize("q_lens, s_lens, splits", [([1, 1, 1], [9, 30, 3], None), ([1, 1], [40, 17], 4),
                                                    ([7, 1, 12], [20, 5, 12], None)])
def test_triton_forward_mla_matches_reference(q_lens, s_lens, splits):
    md, cache, query = _batch(q_lens, s_lens)
    flat = cache.view(-1, R + ROPE)
    latent = flat[md.slot_mapping.clamp(min=0)].clone()  # this step's latents: rewritten where they are
    out = TritonAttentionBackend(num_splits=splits).forward_mla(query, latent, cache, md, 0.3, R)
    ref = mla_attention_ref(query, latent, cache, md, 0.3, R)
    assert out.shape == (sum(q_lens), H, R)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_absorbed_attention_equals_expanded_heads():
    # One request of 10 cached tokens, 3 new: expand the latents with W_UK / W_UV and attend per head.
    torch.manual_seed(0)
    md, cache, _ = _batch([3], [10])
    w_uk, w_uv = torch.randn(H, NOPE, R), torch.randn(H, V, R)
    q_nope, q_pe = torch.randn(3, H, NOPE), torch.randn(3, H, ROPE)
    q_abs = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], -1)
    latent = cache.view(-1, R + ROPE)[md.slot_mapping]
    o_lat = mla_attention_ref(q_abs.to(DEVICE), latent, cache, md, 0.2, R).cpu()
    out = torch.einsum("thr,hvr->thv", o_lat, w_uv)
    ctx = cache.view(-1, R + ROPE)[torch.tensor([b * 4 + o for b in md.block_table[0].tolist() for o in range(4)])][:10].cpu()
    c, k_pe = ctx[:, :R], ctx[:, R:]
    k = torch.cat([torch.einsum("sr,hnr->shn", c, w_uk), k_pe[:, None].expand(10, H, ROPE)], -1)
    v = torch.einsum("sr,hvr->shv", c, w_uv)
    q = torch.cat([q_nope, q_pe], -1)
    s = torch.einsum("thd,shd->hts", q, k) * 0.2
    s = s.masked_fill(torch.arange(10)[None, None, :] > (7 + torch.arange(3))[None, :, None], float("-inf"))
    ref = torch.einsum("hts,shv->thv", torch.softmax(s, -1), v)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_latents_write_through_the_kv_write_kernel():
    # The CUDA path of attention/mla.write_latents: one cache viewed as both K and V.
    from pagedllm.kernels.kv_cache_write import write_kv_cache

    cache = torch.zeros(1, 4, 4, 1, R + ROPE, device=DEVICE)
    latent = torch.randn(3, R + ROPE, device=DEVICE)
    slots = torch.tensor([5, -1, 9], device=DEVICE)
    write_kv_cache(latent[:, None], latent[:, None], cache.expand(2, *cache.shape[1:]), slots)
    flat = cache.view(-1, R + ROPE)
    torch.testing.assert_close(flat[[5, 9]], latent[[0, 2]])
    assert torch.count_nonzero(flat) == torch.count_nonzero(latent[[0, 2]])


def test_deepseek_width_latent_takes_the_small_tile_config():
    # 512 + 64 = 576 features (padded to 1024 in the kernel): the MLA tile config of _tile_config.
    g = torch.Generator().manual_seed(1)
    md = build_metadata([3, 1], [9, 6], [[2, 0, 1], [3, 4]], 4, device=DEVICE)
    cache = torch.randn(1, 5, 4, 1, 576, generator=g).to(DEVICE)
    query = torch.randn(4, 16, 576, generator=g).to(DEVICE)
    latent = cache.view(-1, 576)[md.slot_mapping].clone()
    out = TritonAttentionBackend().forward_mla(query, latent, cache, md, 0.05, 512)
    torch.testing.assert_close(out, mla_attention_ref(query, latent, cache, md, 0.05, 512), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_rc", [None, 0])  # the default (chunked) kernel and the one-piece one
@pytest.mark.parametrize("s_lens, heads, splits", [([9, 30, 3, 1], H, None), ([40, 17], 20, 4), ([33], 3, 2)])
def test_mla_decode_kernel_matches_reference(s_lens, heads, splits, num_rc):
    # The decode-only kernel: head blocks of 16 (20 heads = one full block + a masked one, 3 = masked rows),
    # ragged key tiles, split-K partitions with empty trailing ones (33 keys cut in 2 of 32-key tiles).
    from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref

    md, cache, _ = _batch([1] * len(s_lens), s_lens, seed=3)
    query = torch.randn(len(s_lens), heads, R + ROPE, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = mla_decode(query, cache, md, 0.3, R, num_splits=splits, num_rc=num_rc)
    ref = mla_decode_ref(query, cache, md, 0.3, R)
    assert out.shape == (len(s_lens), heads, R)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_rc, splits, chunk", [(2, None, None), (2, 4, None), (1, 2, None), (2, None, 16)])
def test_mla_decode_chunked_kernel_matches_reference(num_rc, splits, chunk):
    # `_mla_decode_rc_kernel`: the latent's R columns in num_rc chunks (R 32 -> 2 x 16), the query
    # reloaded per key tile; unsplit, split-K and fixed partitions equal the reference as the one-piece kernel.
    from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref

    md, cache, _ = _batch([1, 1, 1, 1], [9, 30, 3, 1], seed=6)
    md.max_seq_len = 64
    query = torch.randn(4, 20, R + ROPE, generator=torch.Generator().manual_seed(7)).to(DEVICE)  # 20 heads: 2 blocks
    out = mla_decode(query, cache, md, 0.3, R, num_splits=None if chunk else splits, split_chunk=chunk, num_rc=num_rc,
                     tile=(16, 4, 2))
    torch.testing.assert_close(out, mla_decode_ref(query, cache, md, 0.3, R), atol=1e-4, rtol=1e-4)


def test_mla_decode_chunked_kernel_at_deepseek_width():
    # DeepSeek's 512 + 64 latent in 4 chunks of 128.
    from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref

    md, _, _ = _batch([1, 1], [6, 11], seed=5)
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(1, 5, 4, 1, 576, generator=g).to(DEVICE)
    wq = torch.randn(2, 16, 576, generator=g).to(DEVICE) * 0.05
    torch.testing.assert_close(mla_decode(wq, wide, md, 0.1, 512, num_rc=4), mla_decode_ref(wq, wide, md, 0.1, 512),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="num_rc"):
        mla_decode(wq, wide, md, 0.1, 512, num_rc=3)


def test_mla_decode_kernel_zeroes_graph_padding_rows():
    # A CUDA-graph batch padded past its requests: those rows come back as zeros, real rows unchanged.
    from pagedllm.kernels.mla_decode import mla_decode, mla_decode_ref

    md, cache, query = _batch([1, 1], [6, 11], seed=5)
    wide = torch.randn(1, cache.shape[1], 4, 1, 576).to(DEVICE)  # DeepSeek's 512 + 64 latent
    wq = torch.randn(2, 16, 576).to(DEVICE) * 0.05
    torch.testing.assert_close(mla_decode(wq, wide, md, 0.1, 512), mla_decode_ref(wq, wide, md, 0.1, 512),
                               atol=1e-4, rtol=1e-4)
    padded = torch.cat([query, torch.randn(2, H, R + ROPE).to(DEVICE)])
    out = mla_decode(padded, cache, md, 0.5, R)
    torch.testing.assert_close(out[:2], mla_decode_ref(query, cache, md, 0.5, R), atol=1e-4, rtol=1e-4)
    assert torch.count_nonzero(out[2:]) == 0


def test_mla_decode_fixed_size_partitions_match_reference():
    # Partitions of a fixed number of keys (split_chunk): requests shorter than the longest skip the
    # programs past their keys and the merge reads only the written ones; a seq_len-0 row stays zero.
    from pagedllm.kernels.mla_decode import mla_decode

    md, cache, query = _batch([1, 1, 1, 1], [5, 40, 17, 33])
    md.seq_lens[0], md.seq_lens_cpu[0], md.max_seq_len = 0, 0, 64  # a CUDA graph's padding row and bound
    ref = mla_attention_ref(query, torch.zeros(4, R + ROPE, device=DEVICE), cache, md, 0.3, R)
    for chunk in (16, 48):
        out = mla_decode(query, cache, md, 0.3, R, tile=(16, 4, 1), split_chunk=chunk)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not out[0].any()


def test_mla_decode_large_batches_default_to_fixed_partitions(monkeypatch):
    # From AUTO_CHUNK_MIN_REQS requests on, no num_splits / split_chunk means fixed partitions of
    # AUTO_SPLIT_CHUNK keys (lowered here to keep the interpreter quick); the result equals the reference.
    from pagedllm.kernels import mla_decode as mod

    monkeypatch.setattr(mod, "AUTO_CHUNK_MIN_REQS", 4)
    monkeypatch.setattr(mod, "AUTO_SPLIT_CHUNK", 16)
    md, cache, query = _batch([1] * 5, [5, 40, 17, 33, 1])
    md.max_seq_len = 64  # as a CUDA graph captures it
    seen = []
    real = mod._mla_merge_kernel
    monkeypatch.setattr(mod, "_mla_merge_kernel", type("K", (), {"__getitem__": lambda self, grid: (
        lambda *a, **kw: (seen.append(kw["FIXED_CHUNK"]), real[grid](*a, **kw)))})())
    ref = mla_attention_ref(query, torch.zeros(5, R + ROPE, device=DEVICE), cache, md, 0.3, R)
    torch.testing.assert_close(mod.mla_decode(query, cache, md, 0.3, R, tile=(16, 4, 1)), ref, atol=1e-4, rtol=1e-4)
    assert seen == [True]
