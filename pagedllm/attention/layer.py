"""The `Attention` module every model uses; it owns no weights, only a slot for its KV cache.

Models hand it the raw qkv GEMM output (`forward_qkv`): q/k split, the optional per-head q/k
RMSNorm, the rotary embedding, the K/V write and attention all happen in the backend
(attention/backend.py), which picks its kernels (the Triton backend fuses prep, or prep and a
decode step's attention, into one kernel; the CPU ones run them separately).

The qkv GEMM output may be a `ScaledOutput` (an FP8 qkv_proj that deferred its scales,
PAGEDLLM_FP8_DEFER_SCALES=1): a backend whose `takes_scaled_qkv` says so gets it as is (the Triton
backend's fused kernels apply the scales as they read qkv); everywhere else `forward_qkv` materializes it
first, here, so no backend sees one it cannot take.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionHeads, TorchAttentionBackend, split_norm_rotate
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kernels.quantized_activation import ScaledOutput


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
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{prefix}: sliding_window must be >= 1, got {sliding_window}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix}: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.heads = AttentionHeads(num_heads, num_kv_heads, head_dim)
        self.scale = scale
        self.prefix = prefix
        self.sliding_window = sliding_window  # a query at p sees keys p - W + 1 .. p (None: all)
        self.logits_soft_cap = logits_soft_cap  # scores s -> cap * tanh(s / cap) (Gemma 2)
        # Passed to the backend only when set, so layers without them call it as before.
        self._extra = {k: v for k, v in (("sliding_window", sliding_window), ("logits_soft_cap", logits_soft_cap))
                       if v}
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchAttentionBackend()
        # Per-tensor scales of an fp8 KV cache (quantization/kv_cache.py): the cache holds K / k_scale
        # and V / v_scale. softmax(q . K * scale) = softmax(q . (K / k_scale) * scale * k_scale), and
        # attention is linear in V, so both fold into the call around the kernels.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def bind_kv_cache(self, kv_cache: torch.Tensor | None, backend: AttentionBackend) -> None:
        self.kv_cache = kv_cache
        self.backend = backend

    def forward_qkv(
        self,
        qkv: torch.Tensor | ScaledOutput,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        positions: torch.Tensor,  # (num_tokens,)
        rotary_emb: nn.Module,  # pagedllm.layers.rotary_embedding.RotaryEmbedding
        attn_metadata: AttentionMetadata,
        q_norm: nn.Module | None = None,  # RMSNorm(head_dim), applied per head before rope (Qwen3)
        k_norm: nn.Module | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        if isinstance(qkv, ScaledOutput) and not self._takes_scaled(qkv, rotary_emb, q_norm, k_norm):
            from pagedllm.kernels.scaled_mm import materialize  # (Triton: only where a ScaledOutput exists)

            qkv = materialize(qkv)
        if self._scaled_cache():
            # An fp8 cache with checkpoint scales: the backend's fused prep kernels write K/V unscaled,
            # so prep runs separately here and `forward` folds the scales in.
            q, k, v = split_norm_rotate(qkv, positions, rotary_emb, self.heads, q_norm, k_norm)
            return self.forward(q, k, v, attn_metadata)
        return self.backend.forward_qkv(qkv, positions, rotary_emb, self.kv_cache, attn_metadata, self.scale,
                                        self.heads, q_norm, k_norm, **self._extra)

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads * head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        t = q.shape[0]
        scale = self.scale
        if self._scaled_cache():  # K / k_scale and V / v_scale go to the cache (quantization/kv_cache.py)
            k, v, scale = k / self.k_scale, v / self.v_scale, scale * self.k_scale
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            scale,
            **self._extra,
        )
        if self._scaled_cache():
            out = out * self.v_scale
        return out.reshape(t, self.num_heads * self.head_dim)

    def _takes_scaled(self, qkv: ScaledOutput, rotary_emb: nn.Module, q_norm: nn.Module | None,
                      k_norm: nn.Module | None) -> bool:
        """Whether the backend applies qkv's scales itself on this call: not with checkpoint cache scales
        (prep runs separately here), else where its `takes_scaled_qkv` says so."""
        takes = getattr(self.backend, "takes_scaled_qkv", None)
        return (not self._scaled_cache() and takes is not None
                and takes(qkv, rotary_emb, self.kv_cache, q_norm, k_norm))

    def _scaled_cache(self) -> bool:
        """An fp8 cache with checkpoint scales other than 1.0."""
        return (self.kv_cache is not None and self.kv_cache.element_size() == 1
                and (self.k_scale != 1.0 or self.v_scale != 1.0))
