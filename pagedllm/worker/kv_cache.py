"""The paged KV cache a worker owns: its element type, its size per block, and the per-layer tensors
bound into the model's `Attention` layers.

One tensor per attention layer, shaped (2, num_blocks, block_size, num_kv_heads, head_dim): index 0
holds keys, 1 values; on a GPU head-major in memory (`kv_cache_layout`), which the kernels read by its
strides. An MLA layer holds (1, num_blocks, block_size, 1, latent width) instead. Block ids are the
scheduler's (core/block_pool.py); a token's slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.config import KV_CACHE_DTYPES, EngineConfig

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(config: EngineConfig) -> tuple[torch.dtype, str]:
    """The KV cache's element type and why: `kv_cache_dtype` when given; for "auto" the model dtype,
    except GGUF weights computed on their blocks on the CPU, whose cache is float16 (llama.cpp's
    default): a decode step there reads the whole cache, so half the bytes is a shorter step, and
    their compute is quantized already (greedy tokens then first differ from transformers' float32
    ones late, if at all: docs/CPU_PROFILE.md)."""
    asked = config.cache_config.cache_dtype
    if asked != "auto":
        return KV_CACHE_DTYPES[asked], "kv_cache_dtype"
    mc = config.model_config
    device = config.device_config.device
    if device == "cpu":
        from pagedllm.quantization.gguf import computes_on_gguf_blocks

        if computes_on_gguf_blocks(mc, torch.device(device)):
            return torch.float16, "auto: GGUF blocks computed on the CPU (--kv-cache-dtype float32 for float32)"
    return mc.dtype, "auto: the model dtype"


def kv_cache_bytes_per_block(config: EngineConfig, pp_rank: int = 0) -> int:
    """Bytes of one block on one rank: only its pipeline stage's layers and its TP share of the KV
    heads (8 kv heads at tp 2: 4 per rank; 2 at tp 4: one replicated head each)."""
    from pagedllm.distributed.utils import get_pp_indices, num_kv_heads_per_rank

    mc = config.model_config
    pc = config.parallel_config
    start, end = get_pp_indices(mc.num_layers, pp_rank, pc.pipeline_parallel_size)
    kv_heads = num_kv_heads_per_rank(mc.num_kv_heads, pc.tensor_parallel_size)
    elem = torch.empty((), dtype=resolve_kv_cache_dtype(config)[0]).element_size()
    latent = getattr(mc.hf_config, "kv_lora_rank", None)
    if latent:  # MLA (DeepSeek): one latent of kv_lora_rank + rope dim per token and layer, on every TP rank
        width = int(latent) + int(mc.hf_config.qk_rope_head_dim)
        return (end - start) * config.cache_config.block_size * width * elem
    return 2 * (end - start) * config.cache_config.block_size * kv_heads * mc.head_dim * elem


def kv_cache_layout(device: torch.device) -> str:
    """The standard cache's memory order on `device`, "NHD" or "HND" (PAGEDLLM_KV_CACHE_LAYOUT; "auto": HND on
    a GPU, NHD elsewhere). Anything else is refused by name."""
    from pagedllm.envs import environment_variables

    layout = environment_variables["PAGEDLLM_KV_CACHE_LAYOUT"]().upper()
    if layout == "AUTO":
        return "HND" if device.type == "cuda" else "NHD"
    if layout not in ("NHD", "HND"):
        raise ValueError(f"PAGEDLLM_KV_CACHE_LAYOUT must be auto, NHD or HND, got {layout!r}")
    return layout


def head_major(make: Callable[..., torch.Tensor], shape: tuple[int, ...], **kwargs: Any) -> torch.Tensor:
    """make((2, blocks, kv heads, slots, dim), **kwargs) seen as `shape` = (2, blocks, slots, kv heads, dim): the
    HND memory order under the standard cache's shape (make: torch.empty or torch.zeros)."""
    two, blocks, slots, heads, dim = shape
    return make((two, blocks, heads, slots, dim), **kwargs).transpose(2, 3)


class KVCache:
    """The cache tensors of one worker and the layers they are bound to. `allocate` may run twice:
    once with a few blocks for the memory-profiling pass (then `release`), then at full size."""

    def __init__(self, attn_layers: list[Attention], backend: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, block_size: int, num_kv_heads: int, head_dim: int) -> None:
        self.attn_layers = attn_layers
        self.backend = backend
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.tensors: list[torch.Tensor] = []

    def allocate(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # Unwritten slots are masked out of attention, but a masked value still meets a 0 weight,
        # so they must hold finite numbers: zeros. On the CPU a large torch.empty is a fresh
        # anonymous mapping (glibc mmaps anything over 32 MiB) that the OS zero-fills on first
        # touch, so start-up skips a multi-GiB memset and unused blocks cost no memory. Smaller
        # buffers may reuse heap memory with old contents, so they are zeroed explicitly.
        elem = torch.empty((), dtype=self.dtype).element_size()

        hnd = kv_cache_layout(self.device) == "HND"

        def alloc(shape: tuple[int, ...]) -> torch.Tensor:
            fresh_mapping = self.device.type == "cpu" and math.prod(shape) * elem > 64 * (1 << 20)
            make = torch.empty if fresh_mapping else torch.zeros
            if hnd and len(shape) == 5 and shape[3] > 1:  # one kv head: both orders are the same memory
                return head_major(make, shape, dtype=self.dtype, device=self.device)
            return make(shape, dtype=self.dtype, device=self.device)

        # A layer may declare its own layout (MLA: one latent per token, attention/mla.py); the rest
        # share `shape`.
        self.tensors = [alloc(layer.kv_cache_shape(num_blocks, self.block_size) if hasattr(layer, "kv_cache_shape")
                              else shape) for layer in self.attn_layers]
        for layer, cache in zip(self.attn_layers, self.tensors):
            layer.bind_kv_cache(cache, self.backend)

    def release(self) -> None:
        for layer in self.attn_layers:
            layer.bind_kv_cache(None, self.backend)
        self.tensors = []
