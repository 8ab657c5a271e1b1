"""worker/triton_keys.py: the prefetch fills Triton's own cached installation key (so the first
kernel lookup finds it), only when switched on."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pagedllm.worker import triton_keys  # noqa: E402


def test_prefetch_is_off_by_default(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PAGEDLLM_TRITON_KEY_PREFETCH", raising=False)
    assert triton_keys.prefetch_triton_key() is None


def test_prefetch_fills_tritons_cached_key(monkeypatch: pytest.MonkeyPatch):
    key = triton_keys._triton_key()
    key.cache_clear()
    monkeypatch.setenv("PAGEDLLM_TRITON_KEY_PREFETCH", "1")
    thread = triton_keys.prefetch_triton_key()
    assert thread is not None
    thread.join(120)
    assert not thread.is_alive()
    info = key.cache_info()
    assert info.currsize == 1 and info.misses == 1
    assert key() == key() and key.cache_info().hits == 2  # the launches' calls: no second hash
