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


def test_a_kept_profile_gives_the_budget_without_a_forward(monkeypatch, tmp_path):
    """PAGEDLLM_KEEP_MEMORY_PROFILE: the kept figures and the memory found now give the KV budget; the
    model is never called (a kv_cache or sampler touched would raise here)."""
    from pagedllm.worker import gpu_memory

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 16 * GiB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    path = tmp_path / "profiles" / "k.json"
    gpu_memory.save_kept_profile(path, peak_activations=2 * GiB, non_torch=GiB)
    assert gpu_memory.load_kept_profile(path) == (2 * GiB, GiB)

    class NoKV:
        device = torch.device("cuda", 0)

    available = gpu_memory.profile_available_kv_bytes(
        torch.nn.Linear(2, 2), None, NoKV(), max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096,
        vocab_size=1000, max_logprobs=20, gpu_memory_utilization=0.5, kept=path)
    assert available == 70 * GiB - 16 * GiB - GiB - 2 * GiB
    with pytest.raises(ValueError, match="No GPU memory is left for the KV cache"):
        gpu_memory.profile_available_kv_bytes(
            torch.nn.Linear(2, 2), None, NoKV(), max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096,
            vocab_size=1000, max_logprobs=20, gpu_memory_utilization=0.1, kept=path)


def test_kept_profiles_that_do_not_read_back(tmp_path):
    from pagedllm.worker import gpu_memory

    assert gpu_memory.load_kept_profile(tmp_path / "missing.json") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert gpu_memory.load_kept_profile(tmp_path / "bad.json") is None
    (tmp_path / "partial.json").write_text('{"peak_activations": 5}')
    assert gpu_memory.load_kept_profile(tmp_path / "partial.json") is None
    assert gpu_memory.kept_profile_path(["a", 1]) == gpu_memory.kept_profile_path(["a", 1])
    assert gpu_memory.kept_profile_path(["a", 1]) != gpu_memory.kept_profile_path(["a", 2])
    assert gpu_memory.source_fingerprint() == gpu_memory.source_fingerprint()
