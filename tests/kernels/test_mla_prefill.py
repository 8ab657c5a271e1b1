"""MLA's prefill path (attention/mla_prefill.py, kernels/mla_prefill.py): the Triton kernel equals its
torch reference pass by pass (interpreter on CPU), a request cut over several passes equals one
pass, and the expanded-heads result equals the absorbed latent attention it replaces."""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.mla_prefill import mla_prefill_forward, mla_prefill_ref, plan_mla_step
from pagedllm.attention.mla_ref import mla_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
R, ROPE, H, NOPE, V = 32, 8, 4, 16, 24


def _step(q_lens, s_lens, block_size=4, seed=0, dims=(R, ROPE, NOPE, V)):
    r, rope, nope, v = dims
    g = torch.Generator().manual_seed(seed)
    tables, nxt = [], 0
    for s in s_lens:
        n = -(-s // block_size)
        tables.append(list(range(nxt, nxt + n))[::-1])  # non-contiguous, reversed blocks
        nxt += n
    md = build_metadata(q_lens, s_lens, tables, block_size, device=DEVICE)
    cache = torch.randn(1, nxt, block_size, 1, r + rope, generator=g).to(DEVICE)
    t = sum(q_lens)
    q_nope, q_pe = torch.randn(t, H, nope, generator=g).to(DEVICE), torch.randn(t, H, rope, generator=g).to(DEVICE)
    w_kv = (0.3 * torch.randn(H, nope + v, r, generator=g)).to(DEVICE)
    return md, cache, q_nope, q_pe, w_kv


# Prefill chunks with and without context, a decode among them, and one chunk starting mid-block.
CASES = [([5, 1, 12], [5, 30, 19]), ([17, 3], [40, 3])]


@pytest.mark.parametrize("max_keys", [7, None])
@pytest.mark.parametrize("q_lens, s_lens, dims", [(*CASES[0], (R, ROPE, NOPE, V)),  # padded head dims
                                                  (*CASES[1], (32, 16, 16, 16))])  # powers of two: no masks
def test_kernel_matches_reference_per_pass(q_lens, s_lens, dims, max_keys):
    from pagedllm.kernels.mla_prefill import mla_prefill_attention

    md, cache, q_nope, q_pe, w_kv = _step(q_lens, s_lens, dims=dims)
    r, _, nope, v = dims
    plan = plan_mla_step(md, 4, max_keys=max_keys)
    if max_keys:
        assert len(plan.passes) > 2 and any(e[5] == 0 for p in plan.passes for e in p.entries_host)
    t = md.num_actual_tokens
    outs = [torch.zeros(t, H, v, device=DEVICE) for _ in range(2)]
    lses = [torch.zeros(t, H, device=DEVICE) for _ in range(2)]
    flat = cache.view(-1, cache.shape[-1])
    for p in plan.passes:
        lat = flat[p.slots]
        kv = (lat[:, :r] @ w_kv.reshape(-1, r).T).view(-1, H, nope + v)
        args = (q_nope, q_pe, kv[..., :nope], lat[:, r:], kv[..., nope:])
        mla_prefill_ref(outs[0], lses[0], *args, p.entries_host, 0.3)
        # 16-row tiles: several per chunk, so the masked / unmasked split and skipped tiles are hit.
        mla_prefill_attention(outs[1], lses[1], *args, p.entries, p.tiles_for(16), 0.3, tile=(16, 16, 4, 1))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    pre = torch.cat([torch.arange(a, b) for a, b, q in zip(md.query_start_loc_cpu[:-1].tolist(),
                                                            md.query_start_loc_cpu[1:].tolist(), q_lens) if q > 1])
    torch.testing.assert_close(lses[1][pre], lses[0][pre], atol=1e-4, rtol=1e-4)


def test_expanded_prefill_equals_absorbed_attention():
    md, cache, q_nope, q_pe, w_kv = _step(*CASES[0], seed=1)
    w_uk, w_uv = w_kv[:, :NOPE], w_kv[:, NOPE:]
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], -1)
    latent = cache.view(-1, R + ROPE)[md.slot_mapping]
    want = torch.einsum("thr,hvr->thv", mla_attention_ref(query, latent, cache, md, 0.3, R), w_uv)
    prefill = [i for i in range(md.num_actual_tokens) if i != 5]  # row 5 is the decode's: not written here
    for max_keys in (None, 9):  # one pass; a pass of 9 keys cuts the requests over six passes
        out = torch.zeros(md.num_actual_tokens, H, V, device=DEVICE)
        mla_prefill_forward(out, q_nope, q_pe, cache, w_kv.reshape(-1, R), plan_mla_step(md, 4, max_keys=max_keys),
                            0.3, use_triton=False)
        torch.testing.assert_close(out[prefill], want[prefill], atol=1e-4, rtol=1e-4)


def test_mixed_step_through_the_triton_backend_equals_absorbed_reference():
    # MLAAttention.forward_mla on a mixed step: the decode row through mla_decode (its own decode-only
    # metadata), the chunks through the prefill kernel; every row equals the all-absorbed reference.
    from pagedllm.attention.mla import MLAAttention
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    md, cache, q_nope, q_pe, w_kv = _step(*CASES[0], seed=2)
    latent = cache.view(-1, R + ROPE)[md.slot_mapping].clone()  # the step's latents, as the cache holds them
    attn = MLAAttention(H, R, ROPE, 0.3)
    attn.bind_kv_cache(cache, TritonAttentionBackend())
    out = attn.forward_mla(q_nope, q_pe, latent[:, :R], latent[:, R:], w_kv, md)
    query = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_kv[:, :NOPE]), q_pe], -1)
    want = torch.einsum("thr,hvr->thv", mla_attention_ref(query, latent, cache, md, 0.3, R), w_kv[:, NOPE:])
    torch.testing.assert_close(out, want.reshape(md.num_actual_tokens, -1), atol=1e-4, rtol=1e-4)
