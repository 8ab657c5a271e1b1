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

from pagedllm.attention.backend import forward_mla_torch, forward_qkv_separate
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import paged_attention
from pagedllm.cpu.build import load_cpu_kernels

# Cache element types of the C kernel (KV_F32 / KV_F16 / KV_BF16 in attention.h).
KV_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Prefill chunks longer than this go to the torch reference (see the module docstring).
MAX_C_QUERY_LEN = 256


class _StepRows:
    """What every layer of one step shares (built at the step's first layer): the query rows, and
    whether the kernel takes the step at all (`ok`).

        requests A (3 new tokens, seq_len 10) and B (decode, seq_len 20): query_start_loc [0, 3, 4]
        row_token [0, 1, 2, 3]   row_req [0, 0, 0, 1]   row_seq [8, 9, 10, 20]
    """

    def __init__(self, md: AttentionMetadata, nworkers: int) -> None:
        # The kernel reads these buffers raw: int32 / int64 as the model runner builds them, contiguous.
        self.ok = (
            md.max_query_len <= MAX_C_QUERY_LEN
            and md.query_start_loc_cpu is not None
            and md.seq_lens_cpu is not None
            and md.slot_mapping.device.type == "cpu"
            and md.block_table.dtype == torch.int32
            and md.slot_mapping.dtype == torch.int64
            and md.slot_mapping.is_contiguous()
        )
        if not self.ok:
            return
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
        self.num_tokens = md.num_actual_tokens
        self.seq16 = -(-int(seq.max()) // 16) * 16 if r else 0
        self.block_table = md.block_table if md.block_table.stride(1) == 1 else md.block_table.contiguous()
        self.nworkers = nworkers
        self.ptrs = (md.slot_mapping.data_ptr(), self.block_table.data_ptr(), self.block_table.stride(0),
                     self.row_token.data_ptr(), self.row_req.data_ptr(), self.row_seq.data_ptr())


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._md: AttentionMetadata | None = None
        self._rows: _StepRows | None = None

    @staticmethod
    def available() -> bool:
        return load_cpu_kernels() is not None

    def forward_qkv(self, qkv, positions, rotary_emb, kv_cache, md, scale, heads, q_norm, k_norm,  # noqa: D102
                    sliding_window=None, logits_soft_cap=None):
        # Prep with torch ops, then `forward` (see AttentionBackend in pagedllm/attention/backend.py).
        return forward_qkv_separate(self, qkv, positions, rotary_emb, kv_cache, md, scale, heads, q_norm, k_norm,
                                    sliding_window, logits_soft_cap)

    def forward_mla(self, query, latent, kv_cache, md, scale, v_width):  # noqa: D102 - see AttentionBackend
        # MLA's latent MQA has no C kernel: plain torch (attention/mla_ref.py).
        return forward_mla_torch(query, latent, kv_cache, md, scale, v_width)

    def step_rows(self, md: AttentionMetadata) -> _StepRows | None:
        """The step's query rows, built at its first layer (None without the kernels)."""
        if md is not self._md:
            lib = load_cpu_kernels()
            if lib is None:
                return None
            self._md, self._rows = md, _StepRows(md, lib.cpu_pool_size())
        return self._rows

    def scratch(self, rows: _StepRows, num_heads: int, num_kv_heads: int) -> tuple[int, int]:
        """(address, bytes per worker) of the kernel's scratch for this step's longest context."""
        # Per worker, 64-byte aligned: seq16 slot offsets (int64), then group * seq16 scores (attention.h).
        per_worker = -(-(rows.seq16 * 8 + num_heads // num_kv_heads * rows.seq16 * 4) // 64) * 64 + 64
        if self._scratch.numel() < per_worker * rows.nworkers:
            self._scratch = torch.empty(per_worker * rows.nworkers * 2, dtype=torch.uint8)
        return self._scratch.data_ptr(), per_worker

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
        if sliding_window or logits_soft_cap:
            # The C kernel attends to the whole context without a cap: the torch reference does both.
            return paged_attention(query, key, value, kv_cache, md, scale, sliding_window, logits_soft_cap)
        lib = load_cpu_kernels()
        rows = self.step_rows(md)
        if lib is None or kv_cache is None or rows is None or not rows.ok:
            return paged_attention(query, key, value, kv_cache, md, scale)
        t, num_heads, head_dim = query.shape
        qs, ks, vs = query.stride(), key.stride(), value.stride()
        if not (
            t == rows.num_tokens
            and query.dtype == key.dtype == value.dtype == torch.float32
            and query.device.type == "cpu"
            and kv_cache.dtype in KV_TYPES
            and head_dim % 16 == 0
            and head_dim <= 256
            # (T, heads, head_dim) with each row's heads back to back (a column slice of the fused qkv is fine)
            and qs[2] == ks[2] == vs[2] == 1
            and qs[1] == ks[1] == vs[1] == head_dim
            and kv_cache.is_contiguous()
        ):
            return paged_attention(query, key, value, kv_cache, md, scale)
        _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
        scratch, per_worker = self.scratch(rows, num_heads, num_kv_heads)
        out = torch.empty((t, num_heads, head_dim), dtype=torch.float32)
        slot_mapping, bt, bt_stride, row_token, row_req, row_seq = rows.ptrs
        lib.paged_attention_rows(
            query.data_ptr(), qs[0], key.data_ptr(), ks[0], value.data_ptr(), vs[0], slot_mapping, t,
            out.data_ptr(), num_heads * head_dim, kv_cache.data_ptr(), KV_TYPES[kv_cache.dtype],
            num_blocks * block_size, block_size, num_heads, num_kv_heads, head_dim, bt, bt_stride,
            row_token, row_req, row_seq, rows.n, scale, scratch, per_worker,
        )
        return out
