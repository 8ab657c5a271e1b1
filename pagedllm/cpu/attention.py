"""`CpuAttentionBackend`: the paged attention of decode steps in one C call per layer.

The torch reference (`pagedllm.attention.torch_ref`) gathers every request's K/V into a padded
tensor and runs a masked SDPA: ~40 small torch ops per layer, most of a decode step's attention
time on a CPU. Here a decode-only step (every request has one new token) writes K/V and attends
straight through the block table in C (`paged_decode_attention` in kernels.c), float32 throughout;
steps with a prefill chunk, and shapes the kernel does not take, use the torch reference.

Results equal the reference up to float32 rounding (the order of the sums and exp).
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import paged_attention
from pagedllm.cpu.build import load_cpu_kernels


def _rows_ok(t: torch.Tensor) -> bool:
    # (T, heads, head_dim) with each row's heads back to back (a column slice of the fused qkv is fine)
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def _metadata_ok(md: AttentionMetadata) -> bool:
    # The kernel reads these buffers raw: int32 / int64 as the model runner builds them, contiguous.
    return (
        md.seq_lens.dtype == md.query_start_loc.dtype == md.block_table.dtype == torch.int32
        and md.slot_mapping.dtype == torch.int64
        and md.seq_lens.is_contiguous()
        and md.query_start_loc.is_contiguous()
        and md.slot_mapping.is_contiguous()
    )


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._scratch = torch.empty(0)
        self._reqs = torch.empty(0, dtype=torch.int64)

    @staticmethod
    def available() -> bool:
        return load_cpu_kernels() is not None

    def forward(
        self,
        query: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        key: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        value: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor | None,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        lib = load_cpu_kernels()
        t, num_heads, head_dim = query.shape
        if (
            lib is None
            or kv_cache is None
            or md.max_query_len != 1
            or md.num_actual_tokens != t
            or query.device.type != "cpu"
            or not (query.dtype == key.dtype == value.dtype == kv_cache.dtype == torch.float32)
            or head_dim % 16
            or head_dim > 256
            or not (_rows_ok(query) and _rows_ok(key) and _rows_ok(value) and kv_cache.is_contiguous())
            or not _metadata_ok(md)
        ):
            return paged_attention(query, key, value, kv_cache, md, scale)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        num_slots = num_blocks * block_size
        row = num_kv_heads * head_dim
        lib.write_kv_cache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), kv_cache.data_ptr(),
                           num_slots, md.slot_mapping.data_ptr(), t, row)
        nworkers = lib.cpu_pool_size()
        per_thread = -(-md.max_seq_len // 16) * 16  # one head's scores, rounded up to 16 (kernels.c)
        if self._scratch.numel() < per_thread * nworkers:
            self._scratch = torch.empty(per_thread * nworkers * 2)
        if self._reqs.numel() < md.num_reqs:
            self._reqs = torch.arange(max(md.num_reqs, 2 * self._reqs.numel()), dtype=torch.int64)
        block_table = md.block_table if md.block_table.stride(1) == 1 else md.block_table.contiguous()
        out = torch.empty((t, num_heads, head_dim), dtype=query.dtype)
        lib.paged_decode_attention(
            query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), kv_cache.data_ptr(), num_slots,
            block_size, num_heads, num_kv_heads, head_dim, block_table.data_ptr(), block_table.stride(0),
            md.seq_lens.data_ptr(), md.query_start_loc.data_ptr(), self._reqs.data_ptr(), md.num_reqs, scale,
            self._scratch.data_ptr(), per_thread,
        )
        return out
