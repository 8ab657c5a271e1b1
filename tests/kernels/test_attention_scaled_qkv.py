"""`Attention.forward_qkv` with a ScaledOutput qkv (a deferring FP8 qkv_proj, PAGEDLLM_FP8_DEFER_SCALES=1): the
Triton backend's fused kernels get the scales (in_scales) on a decode-only step and on a mixed one; every other
way (no cache yet, GPT-J rotary, the torch backend, checkpoint cache scales) gets the materialized tensor. Each
gives bit for bit what the layer gives for `scaled_mm.materialize(qkv)`."""

from __future__ import annotations

import pytest
import torch

import pagedllm.attention.triton_backend as triton_backend
from pagedllm.attention.backend import TorchAttentionBackend
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import build_metadata
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.kernels.quantized_activation import ScaledOutput
from pagedllm.kernels.scaled_mm import materialize
from pagedllm.layers.rotary_embedding import get_rope

H, KVH, D = 4, 2, 32
WIDTH = (H + 2 * KVH) * D


@pytest.fixture
def scaled_calls(monkeypatch) -> list[str]:
    """The fused kernels' launches that got in_scales, by name."""
    calls: list[str] = []
    for name in ("fused_qkv_prep", "decode_attention_fused"):
        real = getattr(triton_backend, name)

        def counted(*a, _real=real, _name=name, **k):
            if k.get("in_scales") is not None:
                calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(triton_backend, name, counted)
    return calls


def _scaled(t: int, device: torch.device) -> ScaledOutput:
    # fp32 sums: the CPU interpreter's bf16 attention dots are not faithful (tests/kernels/test_qkv_in_scales.py)
    return ScaledOutput(torch.randn(t, WIDTH, device=device) * 300, torch.rand(t, 1, device=device) * 1e-2 + 1e-3,
                        torch.rand(WIDTH, device=device) * 1e-2 + 1e-3)


def _run(attn: Attention, qkv, positions, rope, md, backend, cache: torch.Tensor | None
         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The layer's output and the cache it wrote (a copy of `cache`)."""
    cache = cache.clone() if cache is not None else None
    attn.bind_kv_cache(cache, backend)
    return attn.forward_qkv(qkv, positions, rope, md), cache


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_fused_kernels_apply_the_scales(device, scaled_calls, step):
    attn = Attention(H, D, D**-0.5, KVH, prefix="layers.0.self_attn.attn")
    rope = get_rope(D, 64, {"rope_type": "default", "rope_theta": 1e4})
    if step == "decode":
        md = build_metadata([1, 1], [10, 3], [[0, 5, 11], [7]], 4, device=device)
        positions = torch.tensor([9, 2], device=device)
    else:  # a prefill of 5 and a decode at position 9
        md = build_metadata([5, 1], [5, 10], [[3, 7], [0, 5, 11]], 4, device=device)
        positions = torch.tensor([0, 1, 2, 3, 4, 9], device=device)
    cache0 = torch.randn(2, 12, 4, KVH, D, device=device)
    y = _scaled(md.num_actual_tokens, device)
    out, cache = _run(attn, y, positions, rope, md, TritonAttentionBackend(), cache0)
    ref, ref_cache = _run(attn, materialize(y), positions, rope, md, TritonAttentionBackend(), cache0)
    assert scaled_calls == ["decode_attention_fused" if step == "decode" else "fused_qkv_prep"]
    assert torch.equal(out, ref) and torch.equal(cache, ref_cache)


def test_every_other_way_materializes_first(device, scaled_calls):
    attn = Attention(H, D, D**-0.5, KVH)
    neox = get_rope(D, 64, {"rope_type": "default", "rope_theta": 1e4})
    gptj = get_rope(D, 64, {"rope_type": "default", "rope_theta": 1e4}, is_neox_style=False)
    md = build_metadata([5, 1], [5, 10], [[3, 7], [0, 5, 11]], 4, device=device)
    positions = torch.tensor([0, 1, 2, 3, 4, 9], device=device)
    cache0 = torch.randn(2, 12, 4, KVH, D, device=device)
    y = _scaled(md.num_actual_tokens, device)
    ways = [(neox, TritonAttentionBackend(), None), (gptj, TritonAttentionBackend(), cache0),
            (neox, TritonAttentionBackend(fused_qkv_prep=False), cache0), (neox, TorchAttentionBackend(), cache0)]
    for rope, backend, cache in ways:
        out, _ = _run(attn, y, positions, rope, md, backend, cache)
        ref, _ = _run(attn, materialize(y), positions, rope, md, backend, cache)
        assert torch.equal(out, ref)
    attn.k_scale = 0.5  # checkpoint scales on an fp8 cache: prep runs separately in the layer
    fp8 = cache0.to(torch.float8_e4m3fn)
    out, cache = _run(attn, y, positions, neox, md, TritonAttentionBackend(), fp8)
    ref, ref_cache = _run(attn, materialize(y), positions, neox, md, TritonAttentionBackend(), fp8)
    assert torch.equal(out, ref) and torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert scaled_calls == []


def test_the_backend_refuses_a_scaled_qkv_it_cannot_take(device):
    md = build_metadata([5], [5], [[3, 7]], 4, device=device)
    rope = get_rope(D, 64, {"rope_type": "default", "rope_theta": 1e4})
    attn = Attention(H, D, D**-0.5, KVH)
    backend = TritonAttentionBackend()
    assert not backend.takes_scaled_qkv(_scaled(5, device), rope, None, None, None)  # profiling: no cache
    with pytest.raises(ValueError, match="takes_scaled_qkv"):
        backend.forward_qkv(_scaled(5, device), torch.arange(5, device=device), rope, None, md, 0.1, attn.heads,
                            None, None)
