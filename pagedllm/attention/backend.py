"""The attention backend hook: one narrow interface, chosen once by the model runner.

Backends: `TorchAttentionBackend` (plain PyTorch; the CPU path and the reference) and, on CUDA,
the Triton backend in `pagedllm.attention.triton_backend`. A backend may also set
`supports_fused_qkv_prep = True` and offer `forward_prepared(query, kv_cache, md, scale)` (attention
only, K/V already written): `Attention.forward_qkv` then writes K/V with the fused prep kernel.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import paged_attention


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys older than the window are masked (see torch_ref)
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...


class TorchAttentionBackend:
    name = "torch"

    def forward(self, query, key, value, kv_cache, md, scale, sliding_window=None,  # noqa: D102 - see Protocol
                logits_soft_cap=None):
        return paged_attention(query, key, value, kv_cache, md, scale, sliding_window, logits_soft_cap)
