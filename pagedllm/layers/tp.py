"""Tensor-parallel seams used by the layers.

Today pagedllm runs one model replica per process, so rank 0 of 1 and the collectives are
identities. The layers already shard their weights and call these functions at the places vLLM
communicates; tensor parallelism later means giving these functions a real process group.
"""

from __future__ import annotations

import torch


def get_tensor_model_parallel_rank() -> int:
    return 0


def get_tensor_model_parallel_world_size() -> int:
    return 1


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum partial results over TP ranks (after RowParallelLinear, after a sharded embedding)."""
    if get_tensor_model_parallel_world_size() == 1:
        return x
    torch.distributed.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate the ranks' shards along `dim` (ColumnParallelLinear with gather_output, logits)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size)]
    torch.distributed.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)
