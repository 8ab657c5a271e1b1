"""`CpuAttentionBackend`: the paged attention of a step in one C call per layer.

The torch reference (`pagedllm.attention.torch_ref`) gathers every request's K/V into a padded
tensor and runs a masked SDPA: ~40 small torch ops per layer, most of a decode step's attention
time on a CPU. Here every query token is a row that attends causally to its own context length
straight through the block table (`paged_attention_rows` in attention.h), after the step's K/V
are written: decode tokens, and the prompt tokens of prefill chunks up to `MAX_C_QUERY_LEN` long
(longer chunks, where a blocked SDPA does better than a row at a time, and shapes the kernel does
not take, use the torch reference).

The cache may be float32, float16 or bfloat16 (`kv_cache_dtype`): new K/V are rounded to it as
torch's `.to(dtype)` rounds, and read back widened to float32; queries, scores, softmax and outputs
are float32. Results equal the reference (which casts the same way) up to float32 rounding (the
order of the sums and exp).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import paged_attention
from pagedllm.cpu.build import load_cpu_kernels

# Cache element types of the C kernel (KV_F32 / KV_F16 / KV_BF16 in attention.h).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Prefill chunks longer than this go to the torch reference (see the module docstring).
MAX_C_QUERY_LEN = 256


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
        and md.query_start_loc_cpu is not None
        and md.seq_lens_cpu is not None
    )


class _StepRows:
    """The rows of one step's metadata, shared by every layer of the step (built once).

        requests A (3 new tokens, seq_len 10) and B (decode, seq_len 20): query_start_loc [0, 3, 4]
        row_token [0, 1, 2, 3]   row_req [0, 0, 0, 1]   row_seq [8, 9, 10, 20]
    """

    def __init__(self, md: AttentionMetadata) -> None:
        r = md.num_reqs
        qsl = md.query_start_loc_cpu[: r + 1].numpy().astype(np.int64)
        seq = md.seq_lens_cpu[:r].numpy().astype(np.int32)
        q_lens = qsl[1:] - qsl[:-1]
        if md.max_query_len == 1:
            row_token, row_req, row_seq = qsl[:-1], np.arange(r, dtype=np.int32), seq
        else:
            row_req = np.repeat(np.arange(r, dtype=np.int32), q_lens)
            row_token = np.arange(int(qsl[-1]), dtype=np.int64)
            row_seq = ((seq - q_lens)[row_req] + 1 + (row_token - qsl[:-1][row_req])).astype(np.int32)
        self.row_token = torch.from_numpy(np.ascontiguousarray(row_token))
        self.row_req = torch.from_numpy(np.ascontiguousarray(row_req))
        self.row_seq = torch.from_numpy(np.ascontiguousarray(row_seq))
        self.n = len(row_token)
        self.max_seq = int(seq.max()) if r else 0
        self.block_table = md.block_table if md.block_table.stride(1) == 1 else md.block_table.contiguous()


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._md: AttentionMetadata | None = None
        self._rows: _StepRows | None = None

    @staticmethod
    def available() -> bool:
        return load_cpu_kernels() is not None

    def _step_rows(self, md: AttentionMetadata) -> _StepRows:
        if md is not self._md:
            self._md, self._rows = md, _StepRows(md)
        assert self._rows is not None
        return self._rows

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
            or md.max_query_len > MAX_C_QUERY_LEN
            or md.num_actual_tokens != t
            or query.device.type != "cpu"
            or not (query.dtype == key.dtype == value.dtype == torch.float32)
            or kv_cache.dtype not in KV_TYPES
            or head_dim % 16
            or head_dim > 256
            or not (_rows_ok(query) and _rows_ok(key) and _rows_ok(value) and kv_cache.is_contiguous())
            or not _metadata_ok(md)
        ):
            return paged_attention(query, key, value, kv_cache, md, scale)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        num_slots = num_blocks * block_size
        kv_type = KV_TYPES[kv_cache.dtype]
        lib.write_kv_cache(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), kv_cache.data_ptr(),
                           num_slots, md.slot_mapping.data_ptr(), t, num_kv_heads * head_dim, kv_type)
        rows = self._step_rows(md)
        # attn_scratch_bytes in attention.h: seq16 slot offsets (int64) and group * seq16 scores, per worker
        seq16 = -(-rows.max_seq // 16) * 16
        per_worker = -(-(seq16 * 8 + num_heads // num_kv_heads * seq16 * 4 + 64) // 64) * 64
        nworkers = lib.cpu_pool_size()
        if self._scratch.numel() < per_worker * nworkers:
            self._scratch = torch.empty(per_worker * nworkers * 2, dtype=torch.uint8)
        out = torch.empty((t, num_heads, head_dim), dtype=query.dtype)
        bt = rows.block_table
        lib.paged_attention_rows(
            query.data_ptr(), query.stride(0), out.data_ptr(), out.stride(0), kv_cache.data_ptr(), kv_type,
            num_slots, block_size, num_heads, num_kv_heads, head_dim, bt.data_ptr(), bt.stride(0),
            rows.row_token.data_ptr(), rows.row_req.data_ptr(), rows.row_seq.data_ptr(), rows.n, scale,
            self._scratch.data_ptr(), per_worker,
        )
        return out
