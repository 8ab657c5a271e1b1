"""Tensor-parallel seams used by the layers: this rank's place in its TP group and the collectives.

The group comes from `pagedllm.distributed` (set up by the worker before the model is built; the
trivial one-rank group otherwise, whose collectives are identities). Layers take the group once at
construction and pass it back here in forward, so nothing per step reads process state.
"""

from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator, get_tp_group


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def tensor_model_parallel_all_reduce(x: torch.Tensor, group: GroupCoordinator | None = None) -> torch.Tensor:
    """Sum partial results over TP ranks (after RowParallelLinear, after a sharded embedding)."""
    return (group or get_tp_group()).all_reduce(x)


def tensor_model_parallel_all_gather(
    x: torch.Tensor, dim: int = -1, group: GroupCoordinator | None = None
) -> torch.Tensor:
    """Concatenate the ranks' shards along `dim` (ColumnParallelLinear with gather_output, logits)."""
    return (group or get_tp_group()).all_gather(x, dim)


def tensor_model_parallel_gather(
    x: torch.Tensor, dst: int = 0, dim: int = -1, group: GroupCoordinator | None = None
) -> torch.Tensor | None:
    """The ranks' shards concatenated along `dim` on TP rank `dst` only; None elsewhere."""
    return (group or get_tp_group()).gather(x, dst, dim)
