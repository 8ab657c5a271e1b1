"""Tensor and pipeline parallelism: process groups, collectives, stage layout (docs/DISTRIBUTED.md)."""

from pagedllm.distributed.parallel_state import (
    GroupCoordinator,
    destroy_model_parallel,
    get_pp_group,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from pagedllm.distributed.utils import get_pp_indices, num_kv_heads_per_rank

__all__ = [
    "GroupCoordinator",
    "destroy_model_parallel",
    "get_pp_group",
    "get_pp_indices",
    "get_tp_group",
    "get_world_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "num_kv_heads_per_rank",
]
