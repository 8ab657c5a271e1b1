"""MLA's plain torch pieces: writing latents into the cache and MQA over it (the CPU path and the
reference for the Triton one). The layer and the latent layout: `pagedllm.attention.mla`."""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import _group_attention


def write_latents(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent (T, W) -> cache slots (-1 = skip). On CUDA the K/V write kernel takes the one cache as
    both K and V (the same rows written twice): no host sync, so decode steps stay graph-capturable."""
    if cache.is_cuda:
        from pagedllm.kernels.kv_cache_write import write_kv_cache

        rows = latent.to(cache.dtype)[:, None, :]
        write_kv_cache(rows, rows, cache.expand(2, *cache.shape[1:]), slot_mapping)
        return
    flat = cache.view(-1, cache.shape[-1])
    valid = slot_mapping >= 0
    flat.index_copy_(0, slot_mapping[valid], latent[valid].to(flat.dtype))


def mla_attention_ref(
    query: torch.Tensor,  # (T, H, W): [q_lat | q_pe]
    latent: torch.Tensor,  # (T, W): this step's latents (already written when the cache exists)
    cache: torch.Tensor | None,  # (1, num_blocks, block_size, 1, W)
    md: AttentionMetadata,
    scale: float,
    v_width: int,  # kv_lora_rank: values are the first v_width features of the latent
) -> torch.Tensor:  # (T, H, v_width)
    """Plain torch MQA over the latent cache, grouped as `torch_ref.paged_attention` (decodes, then
    prefill chunks, one padded SDPA each). Without a cache (the profiling pass) each request attends
    over its own new tokens."""
    t, h, w = query.shape
    out = torch.zeros((t, h, v_width), dtype=query.dtype, device=query.device)
    n = md.num_actual_tokens
    qsl = md.query_start_loc[: md.num_reqs + 1].long()
    q_lens = qsl[1:] - qsl[:-1]
    seq_lens = md.seq_lens[: md.num_reqs].long()
    q_lens_cpu = md.query_start_loc_cpu[1 : md.num_reqs + 1] - md.query_start_loc_cpu[: md.num_reqs]
    for is_decode in (True, False):
        sel_cpu = (q_lens_cpu == 1) if is_decode else (q_lens_cpu > 1)
        if not bool(sel_cpu.any()):
            continue
        idx = torch.nonzero(sel_cpu).flatten().to(query.device)
        max_q = 1 if is_decode else int(q_lens_cpu[sel_cpu].max())
        if cache is None:
            ar = torch.arange(max_q, device=query.device)
            rows = (qsl[idx][:, None] + ar[None, :]).clamp(max=n - 1)
            k_src, s_len = latent[rows][:, :, None, :], q_lens[idx]  # (G, max_q, 1, W)
        else:
            block_size = cache.shape[2]
            max_seq = int(md.seq_lens_cpu[: md.num_reqs][sel_cpu].max())
            num_blocks = -(-max_seq // block_size)
            tables = md.block_table[idx, :num_blocks].long()
            k_src = cache[0][tables].reshape(tables.shape[0], num_blocks * block_size, 1, w)
            s_len = seq_lens[idx]
        _group_attention(query, k_src, k_src[..., :v_width], qsl[idx], q_lens[idx], s_len, max_q, scale, out)
    return out
