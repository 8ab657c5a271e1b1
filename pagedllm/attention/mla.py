"""Multi-head Latent Attention (DeepSeek V2/V3): the paged cache holds one compressed latent per token.

Per token the cache stores [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], one "head" of width
W = kv_lora_rank + rope_dim, shared by every query head; the cache tensor of a layer is
(1, num_blocks, block_size, 1, W) (the leading 1 where GQA layers have K and V, so block copies
and swaps index dim 1 as for every other layer).

    DeepSeek-V2-Lite (27 layers, 512 + 64): 27 * 576 * 2 B = 31,104 B per token in bf16
    Llama-3.1-8B (GQA, 32 layers, 8 KV heads x 128, K and V): 32 * 2 * 8 * 128 * 2 B = 131,072 B
    DeepSeek-V2-Lite with its heads expanded (16 x (192 + 128)): 27 * 16 * 320 * 2 B = 276,480 B

Absorbed weights. kv_b_proj maps c_kv to every head's k_nope (W_UK, (H, nope, r)) and value (W_UV,
(H, v, r)). Instead of expanding the cached latents, the query is folded into latent space:
    q_lat = q_nope @ W_UK              (T, H, r)
    score = (q_lat . c_kv + q_pe . k_pe) * scale = [q_lat | q_pe] . [c_kv | k_pe] * scale
    o_lat = softmax(score) @ c_kv      (T, H, r)
    out   = o_lat @ W_UV^T             (T, H, v)
so attention is MQA over the latent cache (one KV head of width W, values its first r features).
Every step takes this path, decodes and prefill chunks alike (prefill with expanded heads, fewer
FLOPs per key for long prompts, is not built). Backends: one that offers `forward_mla` (Triton)
runs it; otherwise the torch reference below (the CPU path).
"""

from __future__ import annotations

import torch

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import _group_attention


class MLAAttention(Attention):
    """The latent-cache attention of one layer. `forward` takes the projected pieces; the layer's
    model module keeps the weights (kv_b_proj) and hands their absorbed views in."""

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float, prefix: str = "") -> None:
        super().__init__(num_heads, kv_lora_rank + qk_rope_head_dim, scale, num_kv_heads=1, prefix=prefix)
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (1, num_blocks, block_size, 1, self.head_dim)

    def forward_mla(
        self,
        q_nope: torch.Tensor,  # (T, H, nope)
        q_pe: torch.Tensor,  # (T, H, rope), rotated
        kv_c: torch.Tensor,  # (T, r), normed
        k_pe: torch.Tensor,  # (T, rope), rotated
        w_uk: torch.Tensor,  # (H, nope, r)
        w_uv: torch.Tensor,  # (H, v, r)
        md: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H * v)
        t = q_nope.shape[0]
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        query = torch.cat([q_lat, q_pe], dim=-1)  # (T, H, W)
        latent = torch.cat([kv_c, k_pe], dim=-1)  # (T, W)
        n = md.num_actual_tokens
        if self.kv_cache is not None:
            write_latents(latent[:n], self.kv_cache, md.slot_mapping[:n])
        run = getattr(self.backend, "forward_mla", None)
        if run is not None and self.kv_cache is not None:
            o_lat = run(query, self.kv_cache, md, self.scale, self.kv_lora_rank)
        else:
            o_lat = mla_attention_ref(query, latent, self.kv_cache, md, self.scale, self.kv_lora_rank)
        out = torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype), w_uv)
        return out.reshape(t, -1)


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
