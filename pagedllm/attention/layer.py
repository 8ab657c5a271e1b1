"""The `Attention` module every model uses; it owns no weights, only a slot for its KV cache.

Models hand it the raw qkv GEMM output (`forward_qkv`); it splits q/k/v, applies the optional
per-head q/k RMSNorm and the rotary embedding, writes K/V and attends. On a backend that offers it
(the Triton one) with a bound cache and a neox rotary, norm + rotary + K/V write run as one fused
kernel (`pagedllm.kernels.qkv_prep`); PAGEDLLM_FUSED_QKV=0 in the environment (read at import)
turns that off, e.g. for an A/B timing. A decode-only step goes further where the backend offers it:
prep and attention in one kernel (`pagedllm.kernels.decode_attention`); PAGEDLLM_FUSED_DECODE=0
turns that part off.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend, TorchAttentionBackend
from pagedllm.attention.metadata import AttentionMetadata

FUSED_QKV_PREP = os.environ.get("PAGEDLLM_FUSED_QKV", "1") != "0"
FUSED_DECODE = os.environ.get("PAGEDLLM_FUSED_DECODE", "1") != "0"


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
        qkv: torch.Tensor,  # (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim)
        positions: torch.Tensor,  # (num_tokens,)
        rotary_emb: nn.Module,  # pagedllm.layers.rotary_embedding.RotaryEmbedding
        attn_metadata: AttentionMetadata,
        q_norm: nn.Module | None = None,  # RMSNorm(head_dim), applied per head before rope (Qwen3)
        k_norm: nn.Module | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        t = qkv.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if self._use_fused_qkv_prep(qkv, rotary_emb, q_norm, k_norm):
            from pagedllm.kernels.qkv_prep import fused_qkv_prep

            md = attn_metadata
            q_w = q_norm.weight if q_norm is not None else None
            k_w = k_norm.weight if k_norm is not None else None
            eps = next((m.variance_epsilon for m in (q_norm, k_norm) if m is not None), 1e-6)
            if (FUSED_DECODE and getattr(self.backend, "supports_fused_decode", False)
                    and md.max_query_len == 1 and md.num_actual_tokens == md.num_reqs):
                out = self.backend.forward_decode_qkv(
                    qkv, positions, rotary_emb.cos_sin_cache, self.kv_cache, md, self.scale,
                    self.num_heads, self.num_kv_heads, self.head_dim, q_w, k_w, eps,
                )
                return out.reshape(t, q_size)
            n = md.num_actual_tokens
            q = fused_qkv_prep(
                qkv, positions, rotary_emb.cos_sin_cache, self.kv_cache, md.slot_mapping[:n],
                self.num_heads, self.num_kv_heads, self.head_dim, q_w, k_w, eps,
            )
            out = self.backend.forward_prepared(q, self.kv_cache, md, self.scale)
            return out.reshape(t, q_size)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        if q_norm is not None:
            # Normalise every head separately: (T, heads * head_dim) -> (T, heads, head_dim) -> back.
            q = q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, q_size)
        if k_norm is not None:
            k = k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, kv_size)
        q, k = rotary_emb(positions, q, k)
        return self.forward(q, k, v, attn_metadata)

    def _use_fused_qkv_prep(
        self, qkv: torch.Tensor, rotary_emb: nn.Module, q_norm: nn.Module | None, k_norm: nn.Module | None
    ) -> bool:
        # Not in the profiling pass (no cache yet), not on the CPU backends (they lack the method),
        # only for neox rotary (the kernel's pairing) and one eps for both norms.
        if not (FUSED_QKV_PREP and self.kv_cache is not None and not self._scaled_cache()
                and getattr(self.backend, "supports_fused_qkv_prep", False)
                and getattr(rotary_emb, "is_neox_style", False)):
            return False
        eps = [m.variance_epsilon for m in (q_norm, k_norm) if m is not None]
        return len(set(eps)) <= 1 and qkv.dim() == 2

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads * head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads * head_dim)
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        t = q.shape[0]
        scale = self.scale
        if self._scaled_cache():  # the fused kernels above are skipped: they write K and V as they are
            k, v, scale = k / self.k_scale, v / self.v_scale, scale * self.k_scale
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            scale,
        )
        if self._scaled_cache():
            out = out * self.v_scale
        return out.reshape(t, self.num_heads * self.head_dim)

    def _scaled_cache(self) -> bool:
        """An fp8 cache with checkpoint scales other than 1.0."""
        return (self.kv_cache is not None and self.kv_cache.element_size() == 1
                and (self.k_scale != 1.0 or self.v_scale != 1.0))
