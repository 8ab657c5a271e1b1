"""MLA's plain torch pieces: writing latents into the cache and MQA over it (the CPU path and the
reference for the Triton one). The layer and the latent layout: `pagedllm.attention.mla`."""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import _group_attention, request_groups


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
    for g in request_groups(md, query.device):
        if cache is None:
            k_src, s_len = latent[g.new_token_rows(md.num_actual_tokens)][:, :, None, :], g.q_len  # (G, max_q, 1, W)
        else:
            block_size = cache.shape[2]
            max_seq = int(md.seq_lens_cpu[: md.num_reqs][g.sel_cpu].max())
            num_blocks = -(-max_seq // block_size)
            tables = md.block_table[g.idx, :num_blocks].long()
            k_src = cache[0][tables].reshape(tables.shape[0], num_blocks * block_size, 1, w)
            s_len = g.seq_len
        _group_attention(query, k_src, k_src[..., :v_width], g.q_start, g.q_len, s_len, g.max_q, scale, out)
    return out
