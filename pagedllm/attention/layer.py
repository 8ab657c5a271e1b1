"""The `Attention` module every model uses; it owns no weights, only a slot for its KV cache.

Models hand it the raw qkv GEMM output (`forward_qkv`): q/k split, the optional per-head q/k
RMSNorm, the rotary embedding, the K/V write and attention all happen in the backend
(attention/backend.py), which picks its kernels (the Triton backend fuses prep, or prep and a
decode step's attention, into one kernel; the CPU ones run them separately).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionHeads, TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    The worker binds `kv_cache` and `backend` after it has sized the cache (`bind_kv_cache`);
    before that (the profiling pass) attention runs over the new tokens only.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        prefix: str = "",
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.heads = AttentionHeads(num_heads, num_kv_heads, head_dim)
        self.scale = scale
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttentionBackend()

    def bind_kv_cache(self, kv_cache: torch.Tensor | None, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.backend = backend

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        positions: torch.Tensor,  # (num_tokens,)
        rotary_emb: nn.Module,  # pagedllm.layers.rotary_embedding.RotaryEmbedding
        attn_metadata: AttentionMetadata,
        q_norm: nn.Module | None = None,  # RMSNorm(head_dim), applied per head before rope (Qwen3)
        k_norm: nn.Module | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        return self.backend.forward_qkv(qkv, positions, rotary_emb, self.kv_cache, attn_metadata, self.scale,
                                        self.heads, q_norm, k_norm)

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads * head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
        )
        return out.reshape(t, self.num_heads * self.head_dim)
