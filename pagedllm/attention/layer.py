"""The `Attention` module every model uses; it owns no weights, only a slot for its KV cache."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Paged attention over this layer's KV cache.

    The model runner binds `kv_cache` and `backend` after it has sized the cache
    (`bind_kv_cache`); before that (the profiling pass) attention runs over the new tokens only.
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
        self.scale = scale
        self.prefix = prefix
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttentionBackend()

    def bind_kv_cache(self, kv_cache: torch.Tensor | None, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.backend = backend

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
