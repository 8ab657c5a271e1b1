"""`TritonAttentionBackend`: the CUDA path of the attention hook (see `backend.py`).

`forward_qkv` picks one of three ways per layer call, from the step's shape and the switches the
backend was built with (PAGEDLLM_FUSED_QKV / PAGEDLLM_FUSED_DECODE, pagedllm/envs.py):

    decode-only step, cache bound, neox rotary     -> one kernel: norm + rotary + K/V write +
      (fused_decode)                                  attention (`pagedllm.kernels.decode_attention`)
    any other step, cache bound, neox rotary        -> the fused prep kernel writes K/V
      (fused_qkv_prep)                                (`pagedllm.kernels.qkv_prep`), then attention
    otherwise (profiling pass, GPT-J rotary, ...)  -> torch prep, `forward`: K/V scatter + attention

qkv may be a `ScaledOutput` (a deferring FP8 qkv_proj) where `takes_scaled_qkv` holds, i.e. on the two fused
ways: their kernels apply its row and column scales as they read qkv (in_scales); Attention.forward_qkv
materializes it for every other way.

Every launch reads only host ints from the metadata, so a decode-only step can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention import torch_ref
from pagedllm.attention.backend import AttentionHeads, forward_mla_torch, forward_qkv_separate
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla_ref import write_latents
from pagedllm.kernels.decode_attention import decode_attention_fused
from pagedllm.kernels.kv_cache_write import write_kv_cache
from pagedllm.kernels.mla_decode import mla_decode
from pagedllm.kernels.paged_attention import paged_attention
from pagedllm.kernels.qkv_prep import fused_qkv_prep
from pagedllm.kernels.quantized_activation import ScaledOutput


class TritonAttentionBackend:
    """num_splits: None lets `choose_num_splits` decide per step; 1 disables split-K; k > 1 forces it.
    fused_qkv_prep / fused_decode: whether `forward_qkv` may use the fused kernels (see above)."""

    name = "triton"

    def __init__(self, num_splits: int | None = None, fused_qkv_prep: bool = True, fused_decode: bool = True) -> None:
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        self.num_splits = num_splits
        self.fused_qkv_prep = fused_qkv_prep
        self.fused_decode = fused_decode

    def uses_fused_prep(self, qkv: torch.Tensor, rotary_emb: nn.Module, kv_cache: torch.Tensor | None,
                        q_norm: nn.Module | None, k_norm: nn.Module | None) -> bool:
        """Not in the profiling pass (no cache yet), only for neox rotary (the kernels' pairing)
        and one eps for both norms."""
        if not (self.fused_qkv_prep and kv_cache is not None and getattr(rotary_emb, "is_neox_style", False)):
            return False
        eps = [m.variance_epsilon for m in (q_norm, k_norm) if m is not None]
        return len(set(eps)) <= 1 and qkv.dim() == 2

    def takes_scaled_qkv(self, qkv: ScaledOutput, rotary_emb: nn.Module, kv_cache: torch.Tensor | None,
                         q_norm: nn.Module | None, k_norm: nn.Module | None) -> bool:
        """Whether `forward_qkv` applies a ScaledOutput qkv's scales in its kernels: wherever it runs the fused
        ones (both take in_scales)."""
        return self.uses_fused_prep(qkv.acc, rotary_emb, kv_cache, q_norm, k_norm)

    def forward_qkv(
        self,
        qkv: torch.Tensor | ScaledOutput,  # (num_tokens, q_size + 2 * kv_size); ScaledOutput: see takes_scaled_qkv
        positions: torch.Tensor,  # (num_tokens,)
        rotary_emb: nn.Module,
        kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        md: AttentionMetadata,
        scale: float,
        heads: AttentionHeads,
        q_norm: nn.Module | None,
        k_norm: nn.Module | None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, q_size)
        extra = {k: v for k, v in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap)) if v}
        in_scales = None
        if isinstance(qkv, ScaledOutput):
            in_scales, qkv = (qkv.row_scale, qkv.col_scale), qkv.acc
        if not self.uses_fused_prep(qkv, rotary_emb, kv_cache, q_norm, k_norm):
            if in_scales is not None:
                raise ValueError("a ScaledOutput qkv on the unfused path: the caller must check takes_scaled_qkv "
                                 "(Attention.forward_qkv materializes it)")
            return forward_qkv_separate(self, qkv, positions, rotary_emb, kv_cache, md, scale, heads, q_norm, k_norm,
                                        **extra)
        assert kv_cache is not None
        t = qkv.shape[0]
        q_w = q_norm.weight if q_norm is not None else None
        k_w = k_norm.weight if k_norm is not None else None
        eps = next((m.variance_epsilon for m in (q_norm, k_norm) if m is not None), 1e-6)
        nh, nkv, hd = heads.num_heads, heads.num_kv_heads, heads.head_dim
        # The one-kernel decode step has no window / soft-cap: such layers take prep + attention.
        if self.fused_decode and not extra and md.max_query_len == 1 and md.num_actual_tokens == md.num_reqs:
            out = self.forward_decode_qkv(qkv, positions, rotary_emb.cos_sin_cache, kv_cache, md, scale, nh, nkv, hd,
                                          q_w, k_w, eps, in_scales)
            return out.reshape(t, heads.q_size)
        n = md.num_actual_tokens
        q = fused_qkv_prep(qkv, positions, rotary_emb.cos_sin_cache, kv_cache, md.slot_mapping[:n], nh, nkv, hd,
                           q_w, k_w, eps, in_scales=in_scales)
        return self.forward_prepared(q, kv_cache, md, scale, **extra).reshape(t, heads.q_size)

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
        in_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # qkv is a ScaledOutput's acc: its scales
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        """A decode-only step's norm + rotary + K/V write + attention in one launch."""
        return decode_attention_fused(qkv, positions, cos_sin_cache, kv_cache, md, scale, num_heads, num_kv_heads,
                                      head_dim, q_norm_weight, k_norm_weight, eps, num_splits=self.num_splits,
                                      in_scales=in_scales)

    def forward_mla(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, W): [q_lat | q_pe] (attention/mla.py)
        latent: torch.Tensor,  # (num_tokens, W): this step's latents
        kv_cache: torch.Tensor | None,  # (1, num_blocks, block_size, 1, W)
        md: AttentionMetadata,
        scale: float,
        v_width: int,  # values are the first v_width features of each latent
    ) -> torch.Tensor:  # (num_tokens, num_heads, v_width)
        """MLA as MQA over the latent cache. Decode-only batches: the latent decode kernel
        (kernels/mla_decode.py: one read of each latent tile serves scores and values of a block of
        heads). Batches with prefill chunks: the unified kernel, which reads the one cache as both K
        and V (a stride-0 view, no copy); value columns past v_width (the rope part) are dropped.
        (MLAAttention sends prefill chunks to its expanded-heads path instead, attention/mla_prefill.py,
        and only decode-only batches here.) Without a cache (profiling pass) the torch reference runs."""
        if kv_cache is None:
            return forward_mla_torch(query, latent, None, md, scale, v_width)
        n = md.num_actual_tokens
        write_latents(latent[:n], kv_cache, md.slot_mapping[:n])
        if md.is_decode_only and n == md.num_reqs:
            return mla_decode(query, kv_cache, md, scale, v_width, num_splits=self.num_splits)
        kv = kv_cache.expand(2, *kv_cache.shape[1:])
        return paged_attention(query, kv, md, scale, num_splits=self.num_splits)[..., :v_width]
