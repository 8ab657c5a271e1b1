"""The attention backend hook: one narrow interface, chosen once per worker (worker/worker.py).

Backends: `TorchAttentionBackend` (plain PyTorch; the reference and the CPU fallback),
`CpuAttentionBackend` (pagedllm/cpu/attention.py: one C call per layer) and, on CUDA,
`TritonAttentionBackend` (attention/triton_backend.py). The `Attention` layer calls exactly the two
entry points of the Protocol below; which kernels run (separate norm / rotary / K/V write /
attention, the fused prep kernel, or the one-kernel decode step) is the backend's choice, made from
switches it was built with (pagedllm/envs.py, read once at start), never probed by the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_ref import mla_attention_ref, write_latents
from pagedllm.attention.torch_ref import paged_attention


@dataclass(frozen=True)
class AttentionHeads:
    """One layer's head layout: qkv rows are [q (num_heads * head_dim) | k | v (num_kv_heads * head_dim)].

    The sizes are computed once here, not per layer call: every eager step reads them in every layer."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_size: int = field(init=False)  # num_heads * head_dim
    kv_size: int = field(init=False)  # num_kv_heads * head_dim
    split_sizes: tuple[int, int, int] = field(init=False)  # (q_size, kv_size, kv_size): qkv.split's

    def __post_init__(self) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        object.__setattr__(self, "q_size", q_size)
        object.__setattr__(self, "kv_size", kv_size)
        object.__setattr__(self, "split_sizes", (q_size, kv_size, kv_size))


class AttentionBackend(Protocol):
    name: str

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # (num_tokens, q_size + 2 * kv_size), straight from the qkv GEMM
        positions: torch.Tensor,  # (num_tokens,)
        rotary_emb: nn.Module,  # pagedllm.layers.rotary_embedding.RotaryEmbedding
        kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim); None: profiling
        md: AttentionMetadata,
        scale: float,
        heads: AttentionHeads,
        q_norm: nn.Module | None,  # RMSNorm(head_dim) per head before rope (Qwen3), or None
        k_norm: nn.Module | None,
        sliding_window: int | None = None,  # a query at p sees keys p - W + 1 .. p (Mistral, Gemma)
        logits_soft_cap: float | None = None,  # scores s -> cap * tanh(s / cap) (Gemma 2)
    ) -> torch.Tensor:  # (num_tokens, q_size)
        """q/k norm + rotary, K/V written into the cache, attention: the whole layer after its GEMM."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim), normed and rotated
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor | None,
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys older than the window are masked (see torch_ref)
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """K/V written into the cache, then attention over it."""
        ...

    def forward_mla(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, W): [q_nope absorbed into latent space | q_pe]
        latent: torch.Tensor,  # (num_tokens, W): this step's [c_kv | k_pe]
        kv_cache: torch.Tensor | None,  # (1, num_blocks, block_size, 1, W); None: profiling
        md: AttentionMetadata,
        scale: float,
        v_width: int,  # kv_lora_rank: values are each latent's first v_width features
    ) -> torch.Tensor:  # (num_tokens, num_heads, v_width)
        """MLA (attention/mla.py): latents written into the cache, MQA over them."""
        ...


def split_norm_rotate(
    qkv: torch.Tensor, positions: torch.Tensor, rotary_emb: nn.Module, heads: AttentionHeads,
    q_norm: nn.Module | None, k_norm: nn.Module | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The separate-kernel prep: (T, q_size + 2 * kv_size) -> q (T, q_size), k, v (T, kv_size)."""
    t = qkv.shape[0]
    q, k, v = qkv.split(heads.split_sizes, dim=-1)
    if q_norm is not None:
        # Normalise every head separately: (T, heads * head_dim) -> (T, heads, head_dim) -> back.
        q = q_norm(q.reshape(t, heads.num_heads, heads.head_dim)).reshape(t, heads.q_size)
    if k_norm is not None:
        k = k_norm(k.reshape(t, heads.num_kv_heads, heads.head_dim)).reshape(t, heads.kv_size)
    q, k = rotary_emb(positions, q, k)
    return q, k, v


def forward_qkv_separate(
    backend: AttentionBackend, qkv: torch.Tensor, positions: torch.Tensor, rotary_emb: nn.Module,
    kv_cache: torch.Tensor | None, md: AttentionMetadata, scale: float, heads: AttentionHeads,
    q_norm: nn.Module | None, k_norm: nn.Module | None, sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # (num_tokens, q_size)
    """`forward_qkv` from separate kernels: prep with torch ops, then the backend's `forward`."""
    t = qkv.shape[0]
    q, k, v = split_norm_rotate(qkv, positions, rotary_emb, heads, q_norm, k_norm)
    out = backend.forward(
        q.view(t, heads.num_heads, heads.head_dim),
        k.view(t, heads.num_kv_heads, heads.head_dim),
        v.view(t, heads.num_kv_heads, heads.head_dim),
        kv_cache, md, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
    )
    return out.reshape(t, heads.q_size)


class TorchAttentionBackend:
    name = "torch"

    def forward_qkv(self, qkv, positions, rotary_emb, kv_cache, md, scale, heads, q_norm, k_norm,  # noqa: D102
                    sliding_window=None, logits_soft_cap=None):
        return forward_qkv_separate(self, qkv, positions, rotary_emb, kv_cache, md, scale, heads, q_norm, k_norm,
                                    sliding_window, logits_soft_cap)

    def forward(self, query, key, value, kv_cache, md, scale, sliding_window=None,  # noqa: D102 - see Protocol
                logits_soft_cap=None):
        return paged_attention(query, key, value, kv_cache, md, scale, sliding_window, logits_soft_cap)

    def forward_mla(self, query, latent, kv_cache, md, scale, v_width):  # noqa: D102 - see Protocol
        return forward_mla_torch(query, latent, kv_cache, md, scale, v_width)


def forward_mla_torch(query: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor | None,
                      md: AttentionMetadata, scale: float, v_width: int) -> torch.Tensor:
    """`forward_mla` in plain torch (attention/mla_ref.py): the torch and CPU backends' MLA."""
    if kv_cache is not None:
        write_latents(latent[: md.num_actual_tokens], kv_cache, md.slot_mapping[: md.num_actual_tokens])
    return mla_attention_ref(query, latent, kv_cache, md, scale, v_width)
