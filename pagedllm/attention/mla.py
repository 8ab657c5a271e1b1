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
FLOPs per key for long prompts, is not built). Every backend implements `forward_mla`: the torch
and CPU ones with `mla_ref` (plain torch), the Triton one with the latent decode kernel for decode-only
batches (kernels/mla_decode.py) and the unified attention kernel for batches with prefill chunks.
"""

from __future__ import annotations

import torch

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_ref import mla_attention_ref, write_latents

__all__ = ["MLAAttention", "mla_attention_ref", "write_latents"]


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
        # The backend writes the latents and attends (attention/backend.py: forward_mla).
        o_lat = self.backend.forward_mla(query, latent, self.kv_cache, md, self.scale, self.kv_lora_rank)
        out = torch.einsum("thr,hvr->thv", o_lat.to(w_uv.dtype), w_uv)
        return out.reshape(t, -1)
