"""Rank layout, stage split and per-rank KV heads: the arithmetic every rank must agree on."""

from __future__ import annotations

import pytest

from pagedllm.config import ParallelConfig
from pagedllm.distributed.parallel_state import get_tp_group, tp_pp_ranks
from pagedllm.distributed.utils import get_pp_indices, num_kv_heads_per_rank
from pagedllm.executor.rank_worker import output_rank


def test_tp_major_groups_and_output_rank():
    assert tp_pp_ranks(4, 2, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    assert tp_pp_ranks(8, 4, 2) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
    assert output_rank(2, 2) == 2 and output_rank(4, 1) == 0 and output_rank(1, 3) == 2
    with pytest.raises(ValueError, match="world size"):
        tp_pp_ranks(6, 2, 2)


def test_pp_stages_cover_every_layer_once():
    assert [get_pp_indices(30, r, 4) for r in range(4)] == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert [get_pp_indices(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="at least one layer"):
        get_pp_indices(2, 0, 3)


def test_kv_heads_split_or_replicate():
    assert num_kv_heads_per_rank(8, 2) == 4
    assert num_kv_heads_per_rank(8, 16) == 1  # replicated: ranks 2r, 2r+1 share head r
    assert num_kv_heads_per_rank(2, 2) == 1
    with pytest.raises(ValueError, match="do not split"):
        num_kv_heads_per_rank(3, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        num_kv_heads_per_rank(3, 4)


def test_single_process_group_is_trivial():
    g = get_tp_group()
    assert g.world_size == 1 and g.rank_in_group == 0 and g.is_first_rank and g.is_last_rank


def test_parallel_config_backend_defaults_and_refusals():
    assert ParallelConfig().distributed_executor_backend == "uni"
    assert ParallelConfig(tensor_parallel_size=2).distributed_executor_backend == "mp"
    assert ParallelConfig(ray_address="auto").distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="only used by distributed_executor_backend='ray'"):
        ParallelConfig(2, 1, "mp", "auto")
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        ParallelConfig(0)
    with pytest.raises(ValueError, match="'uni' runs one worker"):
        ParallelConfig(2, 1, "uni")


def test_cli_flags_reach_the_parallel_config():
    """The seed's flags, as vLLM spells them."""
    import argparse

    from pagedllm.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--tensor-parallel-size", "4", "--pipeline-parallel-size", "2",
                              "--distributed-executor-backend", "ray", "--ray-address", "auto"])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.tensor_parallel_size, ea.pipeline_parallel_size, ea.distributed_executor_backend,
            ea.ray_address) == (4, 2, "ray", "auto")
