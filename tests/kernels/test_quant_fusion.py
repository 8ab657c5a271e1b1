"""layers/quant_fusion.py: a dynamic W8A8 linear's input quantized by the RMSNorm / SiLU-and-mul kernel that
produces it (kernels/quant_act.py), against the unfused path (norm or activation, then the linear's own
quantization). On a CPU-only machine the kernels run in Triton's interpreter (conftest), the producer is
told its CPU tensors run kernels, and the linear takes the QuantizedActivation through scaled_mm_ref.
INT8 weights: the interpreter rounds int8 exactly (e4m3 not always: test_kv_cache_fp8_kernels.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pagedllm.kernels.quant_act as quant_act
from pagedllm.kernels.quantized_activation import QuantizedActivation
from pagedllm.layers import quant_fusion
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.llama import LlamaMLP
from pagedllm.quantization.w8a8 import W8A8LinearMethod


def _to_w8a8(linear: nn.Module, static: bool = False) -> None:
    """Give a linear int8 per-channel weights (from its random float ones) and a dynamic W8A8 method."""
    w = torch.randn(linear.weight.shape, device=linear.weight.device) * 0.05
    scale = w.abs().amax(1) / 127.0
    linear.weight = nn.Parameter(torch.round(w / scale[:, None]).to(torch.int8), requires_grad=False)
    linear.weight_scale = nn.Parameter(scale, requires_grad=False)
    linear.input_scale = nn.Parameter(torch.tensor([0.02], device=w.device), requires_grad=False) if static else None
    linear.quant_method = W8A8LinearMethod(torch.int8, static_input=static)


@pytest.fixture
def fused(monkeypatch, device):
    """Fusion on, the test's tensors counted as kernel tensors, and the fused kernels' calls counted."""
    calls = {"norm": 0, "act": 0}
    norm_q, act_q = quant_act.rms_norm_quant, quant_act.silu_and_mul_quant

    def counted_norm(*a, **k):
        calls["norm"] += 1
        return norm_q(*a, **k)

    def counted_act(*a, **k):
        calls["act"] += 1
        return act_q(*a, **k)

    monkeypatch.setattr(quant_fusion, "ENABLED", True)
    monkeypatch.setattr(quant_fusion, "_kernel_device", lambda x: True)
    monkeypatch.setattr(quant_act, "rms_norm_quant", counted_norm)
    monkeypatch.setattr(quant_act, "silu_and_mul_quant", counted_act)
    return calls


def test_norm_quantizes_for_its_linear(device, fused, monkeypatch):
    norm = RMSNorm(64).to(device)
    norm.weight.data = 1.0 + 0.2 * torch.randn(64, device=device)
    linear = ReplicatedLinear(64, 48, bias=False).to(device)
    _to_w8a8(linear)
    x, residual = torch.randn(24, 64, device=device), torch.randn(24, 64, device=device)
    qa, r_out = quant_fusion.rms_norm_into(norm, x, residual, linear)
    assert isinstance(qa, QuantizedActivation) and qa.xq.dtype == torch.int8 and fused["norm"] == 1
    monkeypatch.setattr(quant_fusion, "ENABLED", False)
    normed, ref_r = quant_fusion.rms_norm_into(norm, x, residual, linear)  # the unfused path
    assert isinstance(normed, torch.Tensor) and fused["norm"] == 1
    torch.testing.assert_close(r_out, ref_r, atol=1e-6, rtol=1e-6)
    out, ref = linear(qa), linear(normed)
    assert out.dtype == ref.dtype == x.dtype
    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


def test_silu_and_mul_quantizes_for_down_proj(device, fused, monkeypatch):
    mlp = LlamaMLP(64, 96, "silu").to(device)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        _to_w8a8(lin)
    x = torch.randn(20, 64, device=device)
    out = mlp(x)
    assert fused["act"] == 1
    monkeypatch.setattr(quant_fusion, "ENABLED", False)
    ref = mlp(x)
    assert fused["act"] == 1
    torch.testing.assert_close(out, ref, atol=1e-2 * ref.abs().max().item(), rtol=0)


def test_no_fusion_where_the_linear_takes_16_bits(device, fused):
    norm = RMSNorm(64).to(device)
    linear = ReplicatedLinear(64, 48, bias=False).to(device)
    _to_w8a8(linear)
    # Few rows: the W8A16 kernel reads the unquantized input (scaled_mm.choose_path).
    assert isinstance(quant_fusion.rms_norm_into(norm, torch.randn(4, 64, device=device), None, linear),
                      torch.Tensor)
    # A static input scale, an unquantized linear, no consumer: the plain norm.
    static = ReplicatedLinear(64, 48, bias=False).to(device)
    _to_w8a8(static, static=True)
    plain = ReplicatedLinear(64, 48, bias=False).to(device)
    for lin in (static, plain, None):
        assert isinstance(quant_fusion.rms_norm_into(norm, torch.randn(24, 64, device=device), None, lin),
                          torch.Tensor)
    assert fused["norm"] == 0


def test_a_mismatched_quantized_input_is_refused(device):
    from pagedllm.kernels.scaled_mm import w8a8_linear

    qa = QuantizedActivation(torch.zeros(24, 64, dtype=torch.int8, device=device), torch.ones(24, 1, device=device),
                             torch.float32)
    wq, ws = torch.zeros(48, 64, dtype=torch.int8, device=device), torch.ones(48, device=device)
    with pytest.raises(ValueError, match="prequantized_path"):
        w8a8_linear(qa, wq, ws, torch.tensor([0.5], device=device), None)  # a static-scale linear
    with pytest.raises(ValueError, match="prequantized_path"):
        w8a8_linear(qa, wq.to(torch.float8_e4m3fn), ws, None, None)  # fp8 weights, int8 codes


def test_norm_applies_a_scaled_outputs_scales(device, fused):
    # PAGEDLLM_FP8_DEFER_SCALES: the norm after an FP8 o_proj / down_proj gets the unscaled sums and the two
    # scale vectors; fused, it applies them in its kernel; unfused (a 16-bit consumer), materialize first.
    # Both equal materializing the output and then the plain path, bit for bit.
    from pagedllm.kernels.quantized_activation import ScaledOutput
    from pagedllm.kernels.scaled_mm import materialize

    norm = RMSNorm(64).to(device)
    norm.weight.data = 1.0 + 0.2 * torch.randn(64, device=device)
    linear = ReplicatedLinear(64, 48, bias=False).to(device)
    _to_w8a8(linear)
    acc = torch.randn(24, 64, device=device) * 300
    y = ScaledOutput(acc, torch.rand(24, 1, device=device) * 1e-2, torch.rand(64, device=device) * 1e-2)
    residual = torch.randn(24, 64, device=device)
    qa, r_out = quant_fusion.rms_norm_into(norm, y, residual, linear)
    ref_qa, ref_r = quant_fusion.rms_norm_into(norm, materialize(y), residual, linear)
    assert isinstance(qa, QuantizedActivation) and fused["norm"] == 2
    assert torch.equal(qa.xq, ref_qa.xq) and torch.equal(qa.scale, ref_qa.scale) and torch.equal(r_out, ref_r)
    plain = nn.Linear(64, 48).to(device)  # a consumer that takes 16 bits: the norm is not fused
    out, r_plain = quant_fusion.rms_norm_into(norm, y, residual, plain)
    ref_out, ref_r_plain = norm(materialize(y), residual)
    assert torch.equal(out, ref_out) and torch.equal(r_plain, ref_r_plain)


def test_silu_and_mul_applies_a_scaled_outputs_scales(device, fused, monkeypatch):
    # A deferring FP8 gate_up_proj hands SwiGLU its unscaled sums and scales: the fused activation applies
    # them; a 16-bit consumer gets act(materialize(...)). LlamaMLP from such a gate_up equals the MLP from the
    # materialized one, and never offers the ScaledOutput to the int4 path's check (it reads tensor attributes).
    from pagedllm.kernels.quantized_activation import ScaledOutput
    from pagedllm.kernels.scaled_mm import materialize

    mlp = LlamaMLP(64, 96, "silu").to(device)
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        _to_w8a8(lin)
    y = ScaledOutput(torch.randn(24, 192, device=device) * 300, torch.rand(24, 1, device=device) * 1e-2,
                     torch.rand(192, device=device) * 1e-2)
    qa = quant_fusion.silu_and_mul_into(mlp.act_fn, y, mlp.down_proj)
    ref_qa = quant_fusion.silu_and_mul_into(mlp.act_fn, materialize(y), mlp.down_proj)
    assert isinstance(qa, QuantizedActivation) and fused["act"] == 2
    assert torch.equal(qa.xq, ref_qa.xq) and torch.equal(qa.scale, ref_qa.scale)
    out = quant_fusion.silu_and_mul_into(mlp.act_fn, y, nn.Linear(96, 48).to(device))  # not fused
    assert fused["act"] == 2 and torch.equal(out, mlp.act_fn(materialize(y)))
    monkeypatch.setattr(mlp.down_proj, "fuses_silu_and_mul", lambda g: g.dim() == 2 and False)
    assert torch.equal(mlp.forward_from_gate_up(y), mlp.forward_from_gate_up(materialize(y)))


def _llama_layers() -> list[nn.Module]:
    """Four decoder layers of stub linears (no weights), the third with a forward of its own (its output may
    reach something that takes no ScaledOutput)."""
    from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer

    class Odd(LlamaDecoderLayer):
        def forward(self, *args):
            return super().forward(*args)

    class Stub:
        pass

    def layer(cls):
        obj = cls.__new__(cls)
        nn.Module.__init__(obj)
        obj.self_attn = LlamaAttention.__new__(LlamaAttention)
        nn.Module.__init__(obj.self_attn)
        obj.self_attn.qkv_proj, obj.self_attn.o_proj = Stub(), Stub()
        obj.mlp = LlamaMLP.__new__(LlamaMLP)
        nn.Module.__init__(obj.mlp)
        obj.mlp.gate_up_proj, obj.mlp.down_proj = Stub(), Stub()
        return obj

    return [layer(LlamaDecoderLayer), layer(LlamaDecoderLayer), layer(Odd), layer(LlamaDecoderLayer)]


def _marks(layers: list[nn.Module]) -> list[tuple[bool, bool, bool, bool]]:
    """(qkv, o, gate_up, down) defer_output_scales of each layer."""
    return [tuple(getattr(lin, "defer_output_scales", False) for lin in
                  (x.self_attn.qkv_proj, x.self_attn.o_proj, x.mlp.gate_up_proj, x.mlp.down_proj)) for x in layers]


def test_deferred_scales_marks_plain_llama_layers(monkeypatch):
    # Every plain layer's qkv_proj, o_proj and gate_up_proj, and every down_proj but the stage's last (it feeds
    # the final norm) and one before a layer that is not plain, defer; nothing without the switch.
    from pagedllm.models.llama import mark_deferred_scales

    layers = _llama_layers()
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_SCALES", "0")
    mark_deferred_scales(layers)
    assert not any(any(m) for m in _marks(layers))
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_SCALES", "1")
    monkeypatch.delenv("PAGEDLLM_FP8_DEFER_LINEARS", raising=False)  # all four
    mark_deferred_scales(layers)
    t, f = True, False
    assert _marks(layers) == [(t, t, t, t), (t, t, t, f), (f, f, f, f), (t, t, t, f)]


@pytest.mark.parametrize("names,want", [("qkv,gate_up", (True, False, True, False)),
                                        (" o , down", (False, True, False, True)), ("", (False,) * 4)])
def test_deferred_linears_are_the_ones_named(monkeypatch, names, want):
    from pagedllm.models.llama import mark_deferred_scales

    layers = _llama_layers()[:2]  # two plain layers: the first's down_proj may defer
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_SCALES", "1")
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_LINEARS", names)
    mark_deferred_scales(layers)
    assert _marks(layers)[0] == want


def test_a_deferred_linear_name_outside_the_four_is_refused(monkeypatch):
    from pagedllm.models.llama import mark_deferred_scales

    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_SCALES", "1")
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_LINEARS", "qkv,up_proj")
    with pytest.raises(ValueError, match="PAGEDLLM_FP8_DEFER_LINEARS: 'up_proj' not among qkv, o, gate_up, down"):
        mark_deferred_scales(_llama_layers())


def test_defers_scales_rule():
    from pagedllm.kernels.scaled_mm import FP8_DTYPE, defers_scales

    bf16 = torch.bfloat16
    assert defers_scales(64, 4096, 14336, FP8_DTYPE, bf16, True, False)
    assert not defers_scales(16, 4096, 14336, FP8_DTYPE, bf16, True, False)  # the W8A16 GEMV's rows
    assert not defers_scales(300, 4096, 14336, FP8_DTYPE, bf16, True, False)  # prefill-sized
    assert not defers_scales(64, 4096, 14336, torch.int8, bf16, True, False)
    assert not defers_scales(64, 4096, 14336, FP8_DTYPE, torch.float16, True, False)
    assert not defers_scales(64, 4096, 14336, FP8_DTYPE, bf16, False, False)  # static input scale
    assert not defers_scales(64, 4096, 14336, FP8_DTYPE, bf16, True, True)  # a bias


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs CUDA")
def test_deferred_fp8_linear_matches_the_scaled_one():
    from pagedllm.kernels.scaled_mm import FP8_DTYPE, ScaledOutput, ensure_unit_scale, materialize, w8a8_linear

    ensure_unit_scale(torch.device("cuda"))
    w = torch.randn(4096, 14336, device="cuda") * 0.05
    ws = w.abs().amax(1) / 448.0
    wq = (w / ws[:, None]).to(FP8_DTYPE)
    x = torch.randn(64, 14336, device="cuda", dtype=torch.bfloat16)
    y = w8a8_linear(x, wq, ws, None, None, defer_scales=True)
    ref = w8a8_linear(x, wq, ws, None, None)
    assert isinstance(y, ScaledOutput)
    out = materialize(y)
    assert ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2
