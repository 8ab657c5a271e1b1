"""The error when the KV cache gets no GPU memory names what took it (worker/gpu_memory.py)."""

import pytest
import torch

from pagedllm.worker.gpu_memory import GiB, no_room_message, startup_baseline


def test_an_engine_still_alive_is_named_not_counted_as_weights():
    # A tiny model (0.01 GiB) while a previous engine's 41 GiB KV cache is still referenced.
    msg = no_room_message(weights=GiB // 100, allocated=41 * GiB + GiB // 100, activations=GiB // 10, non_torch=0,
                          utilization=0.3, total=140 * GiB)
    assert "weights 0.01 GiB" in msg
    assert "other tensors already allocated in this process 41.00 GiB" in msg and "del llm" in msg
    assert "gpu_memory_utilization=0.3 of 140.0 GiB" in msg
    assert "outside" not in msg


def test_a_model_too_big_for_the_budget():
    msg = no_room_message(weights=16 * GiB, allocated=16 * GiB, activations=2 * GiB, non_torch=3 * GiB,
                          utilization=0.1, total=140 * GiB)
    assert msg.startswith("No GPU memory is left for the KV cache: weights 16.00 GiB, activations 2.00 GiB, "
                          "memory this engine holds outside torch's allocator 3.00 GiB")
    assert "other tensors" not in msg


def test_other_processes_memory_is_not_this_engines_share(monkeypatch):
    # vLLM's rule: gpu_memory_utilization is per engine; another engine's 70 GiB only has to leave
    # the asked share free at start, and is not counted in this engine's budget.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: GiB)
    assert startup_baseline(torch.device("cuda", 0), 0.4) == 69 * GiB
    with pytest.raises(ValueError, match=r"Free memory on device cuda:0 \(70.00/140.00 GiB\) on startup is less than "
                                         r"desired GPU memory utilization \(0.6, 84.00 GiB\)"):
        startup_baseline(torch.device("cuda", 0), 0.6)
