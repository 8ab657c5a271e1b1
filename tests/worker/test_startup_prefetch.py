"""worker/startup_prefetch.py: the Triton key prefetch fills Triton's own cached installation key (so the first
kernel lookup finds it); =0 turns it off."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pagedllm.worker import startup_prefetch  # noqa: E402


def test_prefetch_is_off_at_zero(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDLLM_TRITON_KEY_PREFETCH", "0")
    assert startup_prefetch.prefetch_triton_key() is None


def test_prefetch_fills_tritons_cached_key(monkeypatch: pytest.MonkeyPatch):
    key = startup_prefetch._triton_key()
    key.cache_clear()
    monkeypatch.setenv("PAGEDLLM_TRITON_KEY_PREFETCH", "1")
    thread = startup_prefetch.prefetch_triton_key()
    assert thread is not None
    thread.join(120)
    assert not thread.is_alive()
    info = key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    assert key() == key() and key.cache_info().hits == 2  # the launches' calls: no second hash


def test_the_cuda_context_prefetch_needs_its_switch_and_cuda(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGEDLLM_CUDA_CONTEXT_PREFETCH", "0")
    assert startup_prefetch.prefetch_cuda_context() is None
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("PAGEDLLM_CUDA_CONTEXT_PREFETCH", "1")
        assert startup_prefetch.prefetch_cuda_context() is None  # CUDA not initialised: nothing to do


def test_waiting_for_the_key_joins_the_thread_once(monkeypatch: pytest.MonkeyPatch):
    startup_prefetch._triton_key().cache_clear()
    monkeypatch.setenv("PAGEDLLM_TRITON_KEY_PREFETCH", "1")
    thread = startup_prefetch.prefetch_triton_key()
    startup_prefetch.wait_for_triton_key()
    assert thread is not None and not thread.is_alive()
    assert startup_prefetch._key_thread is None
    startup_prefetch.wait_for_triton_key()  # nothing left to wait for
