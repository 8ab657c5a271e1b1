"""Plain PyTorch paged attention: the CPU execution path and the reference for the GPU kernels.

No per-request Python loop: requests are split into two groups (decodes, query_len == 1, and
prefill chunks, query_len > 1) and each group runs as one padded, masked SDPA call over K/V
gathered through the block table. Splitting keeps one long prefill from padding every decode to
its length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv_cache(
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    slot_mapping: torch.Tensor,  # int64 (num_tokens,), -1 = skip (padding)
) -> None:
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    cache = _indexable(kv_cache)
    k_rows, v_rows = _indexable(_to_cache(key, kv_cache.dtype)), _indexable(_to_cache(value, kv_cache.dtype))
    if cache[0].is_contiguous():
        flat = cache.view(2, -1, *kv_cache.shape[-2:])
        flat[0].index_copy_(0, slot_mapping, k_rows)
        flat[1].index_copy_(0, slot_mapping, v_rows)
    else:  # a head-major cache (PAGEDLLM_KV_CACHE_LAYOUT=HND) has no (slot, head, dim) view: index block, offset
        block_size = kv_cache.shape[2]
        blk, off = slot_mapping // block_size, slot_mapping % block_size
        cache[0][blk, off] = k_rows
        cache[1][blk, off] = v_rows


def _to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the cache dtype; an fp8 cache saturates at its finite max first. torch's CPU cast saturates
    by itself, its CUDA cast turns |x| beyond the max into NaN (seen on the H200: the kernel, which
    saturates, then differed from this reference), so the clamp makes both devices agree."""
    if dtype in FP8_DTYPES and x.dtype not in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        x = x.clamp(-fmax, fmax)
    return x.to(dtype)


def _indexable(t: torch.Tensor) -> torch.Tensor:
    """torch has no CPU index/index_copy kernels for float8: move fp8 caches' bytes as uint8 instead.

    `_to_cache` saturates at +-448 (kv_cache_dtype "fp8"), so nothing becomes NaN on the way in.
    """
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def slot_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """(len(slots), num_kv_heads, head_dim): the rows of one cache half (num_blocks, block_size, heads, dim)
    at these slots (block * block_size + offset), for either memory layout, any cache dtype."""
    block_size = cache.shape[1]
    return _indexable(cache)[slots // block_size, slots % block_size].view(cache.dtype)


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache[tables] for any cache dtype (fp8 through its bytes)."""
    return _indexable(cache)[tables].view(cache.dtype)


class RequestGroup(NamedTuple):
    """One group of a step's requests: its decodes (one query each) or its prefill chunks."""

    sel_cpu: torch.Tensor  # bool (num_reqs,) on the host: the requests in the group
    idx: torch.Tensor  # (G,) their indices, on the query's device
    q_start: torch.Tensor  # (G,) first token row of each request
    q_len: torch.Tensor  # (G,) its new tokens
    q_len_cpu: torch.Tensor  # (G,) the same, on the host
    seq_len: torch.Tensor  # (G,) context length including the new tokens
    max_q: int  # the longest q_len (1 for decodes)

    def new_token_rows(self, num_tokens: int) -> torch.Tensor:
        """(G, max_q) token rows of each request's new tokens, padded slots clamped into range: the
        keys when there is no cache yet (the profiling pass attends over the new tokens only).
            q_start [0, 3], max_q 3, num_tokens 4 -> [[0, 1, 2], [3, 3, 3]]"""
        ar = torch.arange(self.max_q, device=self.q_start.device)
        return (self.q_start[:, None] + ar[None, :]).clamp(max=num_tokens - 1)


def request_groups(md: AttentionMetadata, device: torch.device) -> Iterator[RequestGroup]:
    """The step's requests as at most two groups, decodes first, then prefill chunks (empty groups
    skipped), so one long prefill does not pad every decode to its length."""
    qsl = md.query_start_loc[: md.num_reqs + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = md.seq_lens[: md.num_reqs].long()
    q_lens_cpu = md.query_start_loc_cpu[1 : md.num_reqs + 1] - md.query_start_loc_cpu[: md.num_reqs]
    for is_decode in (True, False):
        sel_cpu = (q_lens_cpu == 1) if is_decode else (q_lens_cpu > 1)
        if not bool(sel_cpu.any()):
            continue
        idx = torch.nonzero(sel_cpu).flatten().to(device)
        max_q = 1 if is_decode else int(q_lens_cpu[sel_cpu].max())
        yield RequestGroup(sel_cpu, idx, qsl[idx], q_lens[idx], q_lens_cpu[sel_cpu], seq_lens[idx], max_q)


def _group_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key_src: torch.Tensor,  # (G, S, num_kv_heads, head_dim) padded keys of the group
    value_src: torch.Tensor,  # (G, S, num_kv_heads, head_dim)
    q_start: torch.Tensor,  # (G,) first token row of each request in `query`
    q_len: torch.Tensor,  # (G,)
    seq_len: torch.Tensor,  # (G,) context length including the new tokens
    max_q: int,
    scale: float,
    out: torch.Tensor,  # (num_tokens, num_heads, head_dim), written in place
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_start: torch.Tensor | None = None,  # (G,) absolute position of key_src[:, 0] (None: 0)
) -> None:
    device = query.device
    ar_q = torch.arange(max_q, device=device)
    # Token row of every (request, query slot); padded slots point at the request's first row.
    # q_start [0, 3], q_len [3, 1], max_q 3 -> rows [[0, 1, 2], [3, 3, 3]], valid [[T,T,T],[T,F,F]]
    q_valid = ar_q[None, :] < q_len[:, None]
    rows = torch.where(q_valid, q_start[:, None] + ar_q[None, :], q_start[:, None])
    q = query[rows]  # (G, max_q, H, D)
    # Absolute position of each query slot; keys up to and including it are visible.
    q_pos = (seq_len - q_len)[:, None] + ar_q[None, :]  # (G, max_q)
    k_pos = torch.arange(key_src.shape[1], device=device)[None, :]  # (1 or G, S)
    if k_start is not None:
        k_pos = k_start[:, None] + k_pos
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # (G, max_q, S)
    mask &= k_pos[:, None, :] < seq_len[:, None, None]
    if sliding_window:  # transformers' rule: key j visible to query i when j > i - window
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask[:, :, 0] |= ~q_valid  # keep padded rows finite; they are dropped below
    k_t, v_t = key_src.transpose(1, 2).to(q.dtype), value_src.transpose(1, 2).to(q.dtype)
    if logits_soft_cap:
        # SDPA has no soft-cap: scores written out, s -> cap * tanh(s / cap), masked softmax.
        group = q.shape[2] // k_t.shape[1]
        k_t, v_t = k_t.repeat_interleave(group, dim=1), v_t.repeat_interleave(group, dim=1)
        scores = torch.matmul(q.transpose(1, 2), k_t.transpose(-1, -2)) * scale  # (G, H, max_q, S)
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        o = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v_t.dtype), v_t).transpose(1, 2)
    else:
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k_t, v_t, attn_mask=mask[:, None], scale=scale, enable_gqa=True,
        ).transpose(1, 2)  # (G, max_q, H, D)
    out[rows[q_valid]] = o[q_valid]


def _key_blocks(
    md: AttentionMetadata, group: RequestGroup, block_size: int, sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The block-table columns a group reads: (G, nb) block ids and, with a window, each row's first
    key position. A windowed row starts at the block holding its first query's oldest visible key,
    so a 32K context with a 4K window gathers ~4K keys, and the blocks freed behind the window
    (core/kv_cache_manager.py) are not read.

        window 8, block_size 4, a decode at position 21 (seq_len 22): keys 14.. -> blocks 3..5,
        k_start 12
    """
    seq_cpu = md.seq_lens_cpu[: md.num_reqs][group.sel_cpu].long()
    last_blk = -(-seq_cpu // block_size)  # (G,) one past the last block
    if not sliding_window:
        return md.block_table[group.idx, : int(last_blk.max())].long(), None
    first_q = seq_cpu - group.q_len_cpu.long()
    first_blk = (first_q - sliding_window + 1).clamp(min=0) // block_size
    width = int((last_blk - first_blk).max())
    cols = (first_blk[:, None] + torch.arange(width)[None, :]).clamp(max=md.block_table.shape[1] - 1)
    tables = torch.gather(md.block_table[group.idx].long(), 1, cols.to(md.block_table.device))
    return tables, (first_blk * block_size).to(md.block_table.device)


def paged_attention(
    query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
    key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim), this step's keys
    value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
    kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
    md: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend. Returns (num_tokens, num_heads, head_dim).

    sliding_window W: a query at position p sees keys p - W + 1 .. p (Mistral, Gemma's local
    layers); logits_soft_cap c: scores s -> c * tanh(s / c) before the softmax (Gemma 2).

    With kv_cache None (the memory-profiling pass before the cache exists) each request attends
    causally over its own new tokens only.
    """
    n = md.num_actual_tokens
    out = torch.zeros_like(query)
    if kv_cache is not None:
        write_kv_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n])
    for g in request_groups(md, query.device):
        if kv_cache is None:
            rows = g.new_token_rows(n)  # keys are the new tokens themselves, padded like the queries
            k_src, v_src, s_len = key[rows], value[rows], g.q_len
        else:
            block_size = kv_cache.shape[2]
            tables, k_start = _key_blocks(md, g, block_size, sliding_window)
            size, num_blocks = tables.shape
            k_src = _gather(kv_cache[0], tables).reshape(size, num_blocks * block_size, *kv_cache.shape[-2:])
            v_src = _gather(kv_cache[1], tables).reshape(size, num_blocks * block_size, *kv_cache.shape[-2:])
            s_len = g.seq_len
        _group_attention(query, k_src, v_src, g.q_start, g.q_len, s_len, g.max_q, scale, out,
                         sliding_window, logits_soft_cap, k_start if kv_cache is not None else None)
    return out
