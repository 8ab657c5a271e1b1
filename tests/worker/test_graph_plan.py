"""Choosing decode graphs from measured replay times (worker/graph_plan.py); CUDA-free."""

from __future__ import annotations

import pytest

from pagedllm.config import resolve_cudagraph_capture_sizes
from pagedllm.worker import graph_plan


def test_every_batch_runs_a_graph_that_fits():
    sizes, _ = resolve_cudagraph_capture_sizes(None, None, 256, 8192)
    # Measured shape of the problem: a non-monotone time curve (Llama-3.1-8B on the H200, ms).
    times = {s: 4.0 + s / 100 for s in sizes}
    times[120] = 5.95
    times[128] = 5.35
    dispatch = graph_plan.plan_dispatch(times)
    assert len(dispatch) == 257
    for n in range(1, 257):
        assert dispatch[n] in sizes and dispatch[n] >= n
    # 113..120 would pad to 120 (5.95 ms); 128 replays >2% faster, so they take it.
    assert dispatch[113] == dispatch[120] == 128
    assert graph_plan.describe(dispatch, sizes) == "113-120 -> 128"


def test_flat_or_increasing_times_keep_the_smallest_size():
    sizes = [1, 2, 4, 8, 16]
    for times in ({s: 1.0 for s in sizes}, {s: float(s) for s in sizes}):
        dispatch = graph_plan.plan_dispatch(times)
        assert dispatch[1:] == [1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16]
        assert graph_plan.describe(dispatch, sizes) == ""


def test_margin_keeps_near_ties():
    # 24 is only 1% faster than 16: not worth padding; 3% is.
    assert graph_plan.plan_dispatch({8: 1.0, 16: 1.0, 24: 0.99})[16] == 16
    assert graph_plan.plan_dispatch({8: 1.0, 16: 1.0, 24: 0.97})[16] == 24
    assert graph_plan.plan_dispatch({8: 1.0, 16: 1.2, 24: 1.05}, margin=0.0)[9] == 24


def test_pick_backend():
    assert graph_plan.pick_backend({"cublas": 5.0, "cublaslt": 4.8}, "cublas") == "cublaslt"
    assert graph_plan.pick_backend({"cublas": 5.0, "cublaslt": 4.95}, "cublas") == "cublas"
    assert graph_plan.pick_backend({"cublas": 5.0}, "cublas") == "cublas"
    with pytest.raises(ValueError, match="default library 'cublas' was not timed"):
        graph_plan.pick_backend({"cublaslt": 1.0}, "cublas")


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="capture sizes must be >= 1"):
        graph_plan.plan_dispatch({0: 1.0, 8: 1.0})
    with pytest.raises(ValueError, match="capture sizes must be >= 1"):
        graph_plan.plan_dispatch({})


def test_tuning_switch(monkeypatch):
    from pagedllm.envs import kernel_switches

    monkeypatch.delenv("PAGEDLLM_GRAPH_TUNING", raising=False)
    assert kernel_switches().graph_tuning
    monkeypatch.setenv("PAGEDLLM_GRAPH_TUNING", "0")
    assert not kernel_switches().graph_tuning


def test_groups_keep_batches_within_their_kind_of_graph():
    # 8 and 16 split their attention (dummy rows make them look slow), 32 does not: no padding from
    # 5-16 up to 32, although 32 replays faster; 16 may still take 24 (same kind).
    times = {8: 1.3, 16: 1.4, 24: 1.1, 32: 1.0}
    kinds = {8: "split", 16: "split", 24: "split", 32: "whole"}
    dispatch = graph_plan.plan_dispatch(times, groups=kinds)
    assert dispatch[8] == 24 and dispatch[16] == 24 and dispatch[25] == 32
    assert graph_plan.plan_dispatch(times)[8] == 32  # without groups


def test_a_kept_plan_is_read_back_only_for_the_same_sizes_and_libraries(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_ROOT", str(tmp_path))
    path = graph_plan.plan_path(["H200", "2.11", [("w", (4, 4), "bf16")], [1, 2, 4]])
    assert path.parent == tmp_path / "graph_plans"
    assert path != graph_plan.plan_path(["H200", "2.11", [("w", (4, 8), "bf16")], [1, 2, 4]])
    assert graph_plan.load_plan(path, [1, 2, 4], ["cublas", "cublaslt"]) is None  # nothing kept yet
    plan = {1: ("cublas", 0.5), 2: ("cublaslt", 0.52), 4: ("cublas", 0.61)}
    graph_plan.save_plan(path, plan)
    assert graph_plan.load_plan(path, [1, 2, 4], ["cublas", "cublaslt"]) == plan
    assert graph_plan.load_plan(path, [1, 2, 4, 8], ["cublas", "cublaslt"]) is None  # other sizes: measure
    assert graph_plan.load_plan(path, [1, 2, 4], ["cublas"]) is None  # a library not offered now
    path.write_text("{not json")
    assert graph_plan.load_plan(path, [1, 2, 4], ["cublas", "cublaslt"]) is None
