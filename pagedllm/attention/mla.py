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
Decode tokens take this path: every backend implements `forward_mla`, the torch and CPU ones with
`mla_ref` (plain torch), the Triton one with the latent decode kernel (kernels/mla_decode.py).

Prefill chunks (query_len > 1) instead expand the latents into per-head keys and values and run
ordinary causal attention (attention/mla_prefill.py: far fewer FLOPs per (query, key) pair); a
mixed step splits into the two. Without a cache (no KV bound yet) everything stays absorbed.
"""

from __future__ import annotations

import torch

from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_prefill import mla_prefill_forward, plan_mla_step
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
        w_kv: torch.Tensor,  # kv_b_proj's weight viewed (H, nope + v, r): W_UK rows, then W_UV rows
        md: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H * v)
        nope = q_nope.shape[2]
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        if self.kv_cache is None or md.max_query_len <= 1:
            return self._absorbed(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, md)
        plan = plan_mla_step(md, self.kv_cache.shape[2])
        t, h, v = q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]
        n = md.num_actual_tokens
        write_latents(torch.cat([kv_c[:n], k_pe[:n]], dim=-1), self.kv_cache, md.slot_mapping[:n])
        out = torch.empty((t, h, v), dtype=q_nope.dtype, device=q_nope.device)
        if t > n:
            out[n:].zero_()
        if plan.decode_md is not None:
            rows = plan.decode_tokens
            dec = self._absorbed(q_nope[rows], q_pe[rows], kv_c[rows], k_pe[rows], w_uk, w_uv, plan.decode_md)
            out.index_copy_(0, rows, dec.view(-1, h, v).to(out.dtype))
        mla_prefill_forward(out, q_nope, q_pe, self.kv_cache, w_kv.reshape(-1, w_kv.shape[2]), plan, self.scale,
                            use_triton=self.backend.name == "triton")
        return out.reshape(t, -1)

    def uses_fused_prep(self, latent: torch.Tensor, rotary_emb: torch.nn.Module) -> bool:
        """Whether the layer's prep runs as kernels/mla_prep.py (then `forward_mla_prepared`): CUDA,
        the Triton backend, neox rotary (the kernel's pairing), a cache bound (not the profiling
        pass) in the latent's dtype (an fp8 cache keeps the separate write and its cast)."""
        return (latent.is_cuda and self.backend.name == "triton" and getattr(rotary_emb, "is_neox_style", False)
                and self.kv_cache is not None and self.kv_cache.dtype == latent.dtype)

    def forward_mla_prepared(
        self,
        q_nope: torch.Tensor,  # (T, H, nope)
        query: torch.Tensor,  # (T, H, W): [. | q_pe rotated]; its first r features are filled here
        latent: torch.Tensor,  # (T, W): [kv_c normed | k_pe rotated], already written to the cache
        w_kv: torch.Tensor,  # kv_b_proj's weight viewed (H, nope + v, r)
        md: AttentionMetadata,
    ) -> torch.Tensor:  # (T, H * v)
        """`forward_mla` after kernels/mla_prep.py: no norm, rotary, cat, cache write or q_pe copy left."""
        nope, r = q_nope.shape[2], self.kv_lora_rank
        w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
        t, h, v = q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]
        if md.max_query_len <= 1:
            torch.bmm(q_nope.transpose(0, 1), w_uk, out=query[..., :r].transpose(0, 1))
            if md.is_decode_only and md.num_actual_tokens == md.num_reqs:
                from pagedllm.kernels.mla_decode import mla_decode

                o_lat = mla_decode(query, self.kv_cache, md, self.scale, r, num_splits=self.backend.num_splits)
            else:  # the backend writes the latents again (the same rows) and attends
                o_lat = self.backend.forward_mla(query, latent, self.kv_cache, md, self.scale, r)
            return self._up_project(o_lat, w_uv)
        plan = plan_mla_step(md, self.kv_cache.shape[2])
        n = md.num_actual_tokens
        q_pe = query[..., r:]
        out = torch.empty((t, h, v), dtype=q_nope.dtype, device=q_nope.device)
        if t > n:
            out[n:].zero_()
        if plan.decode_md is not None:
            rows = plan.decode_tokens
            dec = self._absorbed(q_nope[rows], q_pe[rows], latent[rows, :r], latent[rows, r:], w_uk, w_uv,
                                 plan.decode_md)
            out.index_copy_(0, rows, dec.view(-1, h, v).to(out.dtype))
        mla_prefill_forward(out, q_nope, q_pe, self.kv_cache, w_kv.reshape(-1, w_kv.shape[2]), plan, self.scale,
                            use_triton=True)
        return out.reshape(t, -1)

    def _up_project(self, o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:  # (T, H * v)
        """o_lat (T, H, r) @ W_UV^T per head, straight into the (T, H * v) rows o_proj reads."""
        t, h = o_lat.shape[0], o_lat.shape[1]
        out = torch.empty((t, h, w_uv.shape[1]), dtype=w_uv.dtype, device=o_lat.device)
        torch.bmm(o_lat.to(w_uv.dtype).transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out.view(t, -1)

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  w_uk: torch.Tensor, w_uv: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:  # (T, H * v)
        """Attention in latent space (the module docstring): the decode path."""
        t, h, r = q_nope.shape[0], q_nope.shape[1], self.kv_lora_rank
        # Per-head GEMMs written straight into their destinations (heads as the batch: (H, T, .) views
        # of (T, H, .) rows, which cuBLAS takes as strided matrices): q_lat into the query's first r
        # features, so only q_pe is copied beside it; the output into the (T, H * v) rows o_proj reads.
        query = torch.empty((t, h, r + q_pe.shape[2]), dtype=q_nope.dtype, device=q_nope.device)  # (T, H, W)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=query[..., :r].transpose(0, 1))
        query[..., r:] = q_pe
        latent = torch.cat([kv_c, k_pe], dim=-1)  # (T, W)
        # The backend writes the latents and attends (attention/backend.py: forward_mla).
        o_lat = self.backend.forward_mla(query, latent, self.kv_cache, md, self.scale, r)
        return self._up_project(o_lat, w_uv)
