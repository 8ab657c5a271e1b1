"""`TritonAttentionBackend`: the CUDA path of the attention hook (see `backend.py`).

Per layer and step: scatter this step's K/V into the paged cache, then run the unified
prefill + decode kernel over the cache. Both launches read only host ints from the metadata, so a
decode-only step can be captured in a CUDA graph.

`supports_fused_qkv_prep`: the attention layer may instead write K/V itself, fused with q/k norm
and rotary (`pagedllm.kernels.qkv_prep`), and then call `forward_prepared`, which only attends.
For a decode-only step it may hand over the raw qkv instead (`forward_decode_qkv`): prep and
attention in one kernel (`pagedllm.kernels.decode_attention`).
"""

from __future__ import annotations

import torch

from pagedllm.attention import torch_ref
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.decode_attention import decode_attention_fused
from pagedllm.kernels.kv_cache_write import write_kv_cache
from pagedllm.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    """num_splits: None lets `choose_num_splits` decide per step; 1 disables split-K; k > 1 forces it."""

    name = "triton"
    supports_fused_qkv_prep = True
    supports_fused_decode = True

    def __init__(self, num_splits: int | None = None) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits

    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        if kv_cache is None:
            # Memory-profiling pass before the cache exists: attention over the new tokens only,
            # which the reference does without a cache; it runs once, so speed does not matter.
            return torch_ref.paged_attention(query, key, value, None, md, scale, sliding_window, logits_soft_cap)
        n = md.num_actual_tokens
        write_kv_cache(key[:n], value[:n], kv_cache, md.slot_mapping[:n])
        return paged_attention(query, kv_cache, md, scale, num_splits=self.num_splits,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def forward_prepared(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim), normed and rotated
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim), this step's K/V in it
        md: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """Attention only: the caller has already written this step's K/V (`fused_qkv_prep`)."""
        return paged_attention(query, kv_cache, md, scale, num_splits=self.num_splits,
                               sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def forward_decode_qkv(
        self,
        qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), straight from qkv_proj
        positions: torch.Tensor,  # (num_tokens,)
        cos_sin_cache: torch.Tensor,  # (max_position, rot_dim), neox layout
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        md: AttentionMetadata,  # decode-only
        scale: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """A decode-only step's norm + rotary + K/V write + attention in one launch."""
        return decode_attention_fused(qkv, positions, cos_sin_cache, kv_cache, md, scale, num_heads, num_kv_heads,
                                      head_dim, q_norm_weight, k_norm_weight, eps, num_splits=self.num_splits)

    def forward_mla(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, W): [q_lat | q_pe] (attention/mla.py)
        latent_cache: torch.Tensor,  # (1, num_blocks, block_size, 1, W), this step's latents in it
        md: AttentionMetadata,
        scale: float,
        v_width: int,  # values are the first v_width features of each latent
    ) -> torch.Tensor:  # (num_tokens, num_heads, v_width)
        """MLA as MQA over the latent cache: the unified kernel reads the one cache as both K and V
        (a stride-0 view, no copy); the value columns past v_width (the rope part) are dropped."""
        kv = latent_cache.expand(2, *latent_cache.shape[1:])
        return paged_attention(query, kv, md, scale, num_splits=self.num_splits)[..., :v_width]
