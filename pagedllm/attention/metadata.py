"""Per-step attention metadata: how the flat token batch maps onto requests and KV blocks.

A step packs the new tokens of every scheduled request into one flat batch. Example with three
requests, a 3-token prefill chunk and two decodes, block_size 4:

    query_lens        [3, 1, 1]
    query_start_loc   [0, 3, 4, 5]        # prefix sums, num_reqs + 1 entries
    seq_lens          [7, 9, 2]           # tokens in context *after* this step's tokens are written
    block_table       [[5, 2, 0], [1, 7, 3], [4, 0, 0]]   # padded with 0, read only up to seq_len
    slot_mapping      [2*4+0, 2*4+1, 2*4+2, 3*4+0, 4*4+1]  # block_id * block_size + offset

Query token i of request r sits at absolute position seq_lens[r] - query_lens[r] + i and attends
to keys 0..that position (causal over the cached prefix plus the new tokens).

The KV cache of one layer is a tensor of shape (2, num_blocks, block_size, num_kv_heads, head_dim):
index 0 holds keys, index 1 values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_actual_tokens: int  # tokens in the flat batch (CUDA-graph padding comes after these)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 (num_reqs + 1,), on the model's device
    seq_lens: torch.Tensor  # int32 (num_reqs,), on the model's device
    block_table: torch.Tensor  # int32 (num_reqs, max_blocks_per_req), on the model's device
    slot_mapping: torch.Tensor  # int64 (num_tokens,), on the model's device; -1 = do not write
    # Host copies, so the reference path can plan without a device sync.
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    # Decode-only batches may give the order in which the GPU kernel starts its requests: int32
    # (num_reqs,), longest context first, so the longest programs do not make the last wave (the
    # CUDA-graph runner fills it). Results do not depend on it; None = batch order.
    decode_order: torch.Tensor | None = None

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


def build_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Build metadata from plain lists; used by tests and kernels' references.

    The model runner builds the same object from persistent buffers instead.
    """
    num_reqs = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    width = max((len(b) for b in block_tables), default=1) or 1
    table = torch.zeros((num_reqs, width), dtype=torch.int32)
    slots: list[int] = []
    for r, (q, s, blocks) in enumerate(zip(query_lens, seq_lens, block_tables)):
        table[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(s - q, s):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    qsl_t = torch.tensor(qsl, dtype=torch.int32)
    seq_t = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_actual_tokens=qsl[-1],
        num_reqs=num_reqs,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        query_start_loc=qsl_t.to(device),
        seq_lens=seq_t.to(device),
        block_table=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc_cpu=qsl_t,
        seq_lens_cpu=seq_t,
    )
