"""`CpuDecoderStack`: a CPU step of few tokens through a Llama-family GGUF model in one C call.

Through the nn.Modules a one-stream decode step of SmolLM2-135M (30 layers) spends ~2.5-3 ms of its
~10 ms in Python between ~10 kernels per layer (docs/CPU_PROFILE.md). `llama_decoder_stack`
(decoder.h) runs the same kernels with the same arguments in the same order, so its output equals
the module path bit for bit; this file builds its descriptors once per model (weight pointers, the
layers' KV caches) and once per step (the attention's row tables, positions, buffers).

It takes a step only where the module path would run exactly those kernels:

* every layer a plain `LlamaDecoderLayer` (Llama, SmolLM2, Mistral without a window; not Qwen2's
  biases, Qwen3's q/k norms, Gemma, MoE), RMSNorms of float32 weights, one rotary embedding whose
  forward is the base class's, no tensor or pipeline parallelism;
* every projection on GGUF blocks (`GGUFLinearMethod`) without a bias, and at most
  `max_packed_rows` rows (the module path switches to dequantized panels and BLAS above it);
* the C attention backend with a float32/float16/bfloat16 cache, no sliding window or soft cap,
  and a step whose rows the kernel takes (decode tokens, prefill chunks up to 256 tokens).

Anything else returns None and the caller runs the modules. `PAGEDLLM_CPU_FUSED_DECODER=0` turns it off.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import pagedllm.envs as envs
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.cpu.attention import KV_TYPES, CpuAttentionBackend
from pagedllm.cpu.build import load_cpu_kernels

# Field orders of decoder.h's descriptors (DM_*, DL_*, DS_*).
MODEL_FIELDS = ("hidden", "q", "kv", "inter", "heads", "kv_heads", "head_dim", "rot_dim", "neox", "block_size",
                "num_slots", "kv_type", "cos_sin", "final_norm")
LAYER_FIELDS = ("ln1", "qkv", "qkv_kind", "o", "o_kind", "ln2", "gu", "gu_kind", "down", "down_kind", "kv_cache")
STEP_FIELDS = ("t", "positions", "slot_mapping", "block_table", "bt_stride", "row_token", "row_req", "row_seq",
               "n_rows", "attn_scratch", "attn_scratch_per_worker", "embeddings", "out", "work")


def _plain_rms_norm(norm: nn.Module) -> bool:
    from pagedllm.layers.layernorm import RMSNorm

    return type(norm) is RMSNorm and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()


def _gguf_weight(linear: nn.Module) -> tuple[int, int, int] | None:
    """(tile kind, address, max_packed_rows) of a bias-free linear on GGUF blocks, else None."""
    from pagedllm.quantization.gguf import GGUFLinearMethod

    method = getattr(linear, "quant_method", None)
    if (not isinstance(method, GGUFLinearMethod) or getattr(linear, "bias", None) is not None
            or getattr(linear, "tp_size", 1) != 1 or getattr(linear, "gather_output", False)):
        return None
    packed = linear.gguf_packed
    return packed.kind, packed.data_ptr, method.max_packed_rows


class CpuDecoderStack:
    """The descriptors of one model's decoder stack; `__call__` runs a step or returns None."""

    def __init__(self, model: nn.Module) -> None:
        self.ok = False
        self._model = model
        self._kv_caches: list[torch.Tensor | None] = []
        self._work = torch.empty(0, dtype=torch.float32)
        self._step = np.zeros(len(STEP_FIELDS), dtype=np.int64)
        if not (envs.PAGEDLLM_CPU_FUSED_DECODER and load_cpu_kernels() is not None):
            return
        self.ok = self._describe(model)

    def _describe(self, model: nn.Module) -> bool:
        from pagedllm.layers.rotary_embedding import RotaryEmbedding
        from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        if not (model.is_first_stage and model.is_last_stage and _plain_rms_norm(model.norm)):
            return False
        layers = list(model.layers)
        if not layers:
            return False
        rows, max_rows = [], 1 << 30
        # (linear, its packed blocks): the descriptors hold their addresses; a reload replaces them.
        self._packed: list[tuple[nn.Module, object]] = []
        for layer in layers:
            attn_mod = getattr(layer, "self_attn", None)
            if not (type(layer) is LlamaDecoderLayer and type(attn_mod) is LlamaAttention
                    and type(layer.mlp) is LlamaMLP and _plain_rms_norm(layer.input_layernorm)
                    and _plain_rms_norm(layer.post_attention_layernorm)):
                return False
            attn = attn_mod.attn
            if attn.sliding_window or attn.logits_soft_cap or attn.k_scale != 1.0 or attn.v_scale != 1.0:
                return False
            weights = [_gguf_weight(m) for m in (attn_mod.qkv_proj, attn_mod.o_proj, layer.mlp.gate_up_proj,
                                                 layer.mlp.down_proj)]
            if any(w is None for w in weights):
                return False
            max_rows = min(max_rows, *(w[2] for w in weights))
            (qk, qp, _), (ok_, op, _), (gk, gp, _), (dk, dp, _) = weights
            self._packed += [(m, m.gguf_packed) for m in (attn_mod.qkv_proj, attn_mod.o_proj,
                                                           layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            rows.append([layer.input_layernorm.weight.data_ptr(), qp, qk, op, ok_,
                         layer.post_attention_layernorm.weight.data_ptr(), gp, gk, dp, dk, 0])
        first = layers[0].self_attn
        rope = first.rotary_emb
        if (not isinstance(rope, RotaryEmbedding) or type(rope).forward is not RotaryEmbedding.forward
                or any(layer.self_attn.rotary_emb is not rope for layer in layers)
                or rope.cos_sin_cache.dtype != torch.float32 or not rope.cos_sin_cache.is_contiguous()
                or rope.head_size != first.head_dim):
            return False
        heads = first.attn.heads
        if heads.head_dim % 16 or heads.head_dim > 256:
            return False
        self._rope = rope  # keeps cos_sin_cache (whose address the model descriptor holds) alive
        self.max_rows = max_rows
        self.hidden = model.config.hidden_size
        self.eps = float(model.norm.variance_epsilon)
        self.scale = float(first.scaling)
        self._attn = [layer.self_attn.attn for layer in layers]
        self._layers = np.array(rows, dtype=np.int64)
        self._model_desc = np.array(
            [self.hidden, heads.q_size, heads.kv_size, layers[0].mlp.down_proj.input_size, heads.num_heads,
             heads.num_kv_heads, heads.head_dim, rope.rotary_dim, int(rope.is_neox_style), 0, 0, 0,
             rope.cos_sin_cache.data_ptr(), model.norm.weight.data_ptr()], dtype=np.int64)
        if any(layer.input_layernorm.variance_epsilon != self.eps
               or layer.post_attention_layernorm.variance_epsilon != self.eps for layer in layers):
            return False
        return True

    def _bind_caches(self) -> bool:
        """Point the descriptors at the layers' KV caches (again after a rebind); False when unusable."""
        caches = [a.kv_cache for a in self._attn]
        if len(caches) == len(self._kv_caches) and all(c is d for c, d in zip(caches, self._kv_caches)):
            return self._caches_ok
        self._kv_caches = caches
        first = caches[0]
        self._caches_ok = (
            first is not None and first.dtype in KV_TYPES
            and all(isinstance(a.backend, CpuAttentionBackend) for a in self._attn)
            and all(c is not None and c.shape == first.shape and c.dtype == first.dtype and c.is_contiguous()
                    for c in caches)
        )
        if self._caches_ok:
            _, num_blocks, block_size, _, _ = first.shape
            m = dict(zip(MODEL_FIELDS, range(len(MODEL_FIELDS))))
            self._model_desc[m["block_size"]] = block_size
            self._model_desc[m["num_slots"]] = num_blocks * block_size
            self._model_desc[m["kv_type"]] = KV_TYPES[first.dtype]
            self._layers[:, LAYER_FIELDS.index("kv_cache")] = [c.data_ptr() for c in caches]
        return self._caches_ok

    def __call__(self, embeddings: torch.Tensor, positions: torch.Tensor,
                 md: AttentionMetadata) -> torch.Tensor | None:
        """embeddings (T, hidden) float32, positions (T,) int64 -> the final-normed hidden states
        (T, hidden), or None when this step is not one the stack takes (the caller runs the modules)."""
        t = embeddings.shape[0]
        if (not self.ok or t > self.max_rows or embeddings.dtype != torch.float32 or embeddings.dim() != 2
                or not embeddings.is_contiguous() or positions.dtype != torch.int64 or not positions.is_contiguous()
                or positions.shape[0] != t or not self._bind_caches()
                or not all(m.gguf_packed is p for m, p in self._packed)):
            return None
        backend: CpuAttentionBackend = self._attn[0].backend
        rows = backend.step_rows(md)
        if rows is None or not rows.ok or rows.num_tokens != t:
            return None
        m = self._model_desc
        scratch, per_worker = backend.scratch(rows, int(m[4]), int(m[5]))
        lib = load_cpu_kernels()
        need = t * (3 * m[0] + 3 * m[1] + 3 * m[2] + 3 * m[3])  # decoder_work_floats
        if self._work.numel() < need:
            self._work = torch.empty(int(need), dtype=torch.float32)
        out = torch.empty((t, self.hidden), dtype=torch.float32)
        slot_mapping, bt, bt_stride, row_token, row_req, row_seq = rows.ptrs
        s = self._step
        s[:] = (t, positions.data_ptr(), slot_mapping, bt, bt_stride, row_token, row_req, row_seq, rows.n, scratch,
                per_worker, embeddings.data_ptr(), out.data_ptr(), self._work.data_ptr())
        if not lib.llama_decoder_stack(m.ctypes.data, self._layers.ctypes.data, len(self._attn), s.ctypes.data,
                                       self.eps, self.scale):
            raise MemoryError(f"llama_decoder_stack: no memory for a ({t}, {self.hidden}) step")
        return out


def run_cpu_decoder_stack(model: nn.Module, embeddings: torch.Tensor, positions: torch.Tensor,
                          md: AttentionMetadata | None) -> torch.Tensor | None:
    """The hook LlamaModel.forward calls on the CPU: the stack's output, or None (run the modules)."""
    if md is None or not embeddings.is_cpu:
        return None
    stack = model.__dict__.get("_cpu_decoder_stack")
    if stack is None:
        stack = CpuDecoderStack(model)
        model.__dict__["_cpu_decoder_stack"] = stack
    return stack(embeddings, positions, md) if stack.ok else None
