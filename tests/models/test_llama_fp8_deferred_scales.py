"""PAGEDLLM_FP8_DEFER_SCALES=1 through a tiny random Llama with `quantization="fp8"`: every deferring linear's
consumer applies its scales (qkv_proj -> the fused prep / decode attention kernels, o_proj and down_proj -> the
residual add + RMSNorm, gate_up_proj -> SwiGLU), or materializes the output where it is not fused, and the
logits are bit for bit those of the same model whose deferring linears materialize their own output.

The deferring GEMM (cuBLASLt's per-tensor FP8 call) and the fused kernels run only on a GPU; here the linear is
replaced by its CPU twin (the unit-scale sums through scaled_mm_ref, the scales left in a ScaledOutput), the
layers are told their CPU tensors run kernels (quant_fusion._kernel_device, as tests/kernels/test_quant_fusion.py
does) and the caches are bound to the Triton backend, so the consumers' Triton kernels run in the interpreter
(conftest). What is checked is the plumbing: which consumer gets a ScaledOutput and passes its scales on."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import pagedllm.attention.triton_backend as triton_backend
import pagedllm.kernels.quant_act as quant_act
import pagedllm.quantization.w8a8 as w8a8
from pagedllm.attention.layer import Attention
from pagedllm.attention.triton_backend import TritonAttentionBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.kernels.quantized_activation import QuantizedActivation, ScaledOutput
from pagedllm.kernels.scaled_mm import materialize, quantize_activation, scaled_mm_ref
from pagedllm.layers import quant_fusion
from pagedllm.loader.model_loader import load_model
from tests.models.hf_compare import PagedRunner
from tests.quantization import quant_ckpt as qc

PROMPTS = {"a": list(range(3, 13)), "b": list(range(40, 50))}  # one step of 20 rows: the fused norms' shapes


@pytest.fixture
def deferring(monkeypatch) -> dict[str, Counter]:
    """The switch on, the CPU tensors counted as kernel tensors, and the fused consumers' calls that got
    in_scales counted by kernel ("made" counts the ScaledOutputs the linears returned)."""
    counts: dict[str, Counter] = {"made": Counter(), "in_scales": Counter()}
    monkeypatch.setenv("PAGEDLLM_FP8_DEFER_SCALES", "1")
    monkeypatch.setattr(w8a8, "DEFER_SCALES", True)
    monkeypatch.setattr(quant_fusion, "ENABLED", True)
    monkeypatch.setattr(quant_fusion, "_kernel_device", lambda x: True)
    for module, name in ((quant_act, "rms_norm_quant"), (quant_act, "silu_and_mul_quant"),
                         (triton_backend, "fused_qkv_prep"), (triton_backend, "decode_attention_fused")):
        def counted(*a, _real=getattr(module, name), _name=name, **k):
            counts["in_scales"][_name] += k.get("in_scales") is not None
            return _real(*a, **k)

        monkeypatch.setattr(module, name, counted)
    return counts


def _fake_deferring_linear(counts: dict[str, Counter], materialize_here: bool):
    """w8a8_linear whose defer_scales calls return the unit-scale sums and the scales (a ScaledOutput), or, with
    materialize_here, that ScaledOutput materialized: what a consumer that applies no scales would get."""
    real = w8a8.w8a8_linear

    def linear(x, wq, w_scale, input_scale, bias, path=None, defer_scales=False):
        if not defer_scales:
            return real(x, wq, w_scale, input_scale, bias, path)
        assert input_scale is None and bias is None
        if isinstance(x, QuantizedActivation):
            xq, x_scale, dtype = x.xq, x.scale, x.dtype
        else:
            (xq, x_scale), dtype = quantize_activation(x, wq.dtype), x.dtype
        one = torch.ones((), device=xq.device)
        y = ScaledOutput(scaled_mm_ref(xq, wq, one, one, None, dtype), x_scale, w_scale)
        counts["made"][wq.shape] += 1
        return materialize(y) if materialize_here else y

    return linear


def _run(model, counts, monkeypatch, materialize_here: bool) -> list[torch.Tensor]:
    """Logits of a prefill of both prompts, then one decode step of both, on the Triton backend."""
    monkeypatch.setattr(w8a8, "w8a8_linear", _fake_deferring_linear(counts, materialize_here))
    runner = PagedRunner(model)
    for module in model.modules():
        if isinstance(module, Attention):
            module.bind_kv_cache(module.kv_cache, TritonAttentionBackend())
    first = runner.step(PROMPTS)
    second = runner.step({r: [int(first[r][-1].argmax())] for r in PROMPTS})
    return [*first.values(), *second.values()]


def test_consumers_apply_the_deferred_scales(deferring, monkeypatch):
    ckpt = qc.fidelity_model()[0]
    config = EngineArgs(model=ckpt, skip_tokenizer_init=True, quantization="fp8").create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    layers = model.model.layers
    marks = [[getattr(lin, "defer_output_scales", False) for lin in
              (x.self_attn.qkv_proj, x.self_attn.o_proj, x.mlp.gate_up_proj, x.mlp.down_proj)] for x in layers]
    assert marks == [[True, True, True, True], [True, True, True, False]]  # the last down_proj feeds the norm
    deferred = _run(model, deferring, monkeypatch, materialize_here=False)
    # the prefill (20 rows): every consumer fused with the scales (layer 0's down_proj: layer 1's input norm);
    # the decode step (2 rows): the decode kernel takes qkv's, the norms and SwiGLU (not fused: their linears
    # read 16 bits at 2 rows) get materialized tensors
    assert deferring["in_scales"] == Counter(rms_norm_quant=3, silu_and_mul_quant=2, fused_qkv_prep=2,
                                             decode_attention_fused=2)
    made = sum(deferring["made"].values())
    assert made == 2 * 7  # 2 steps x (2 layers x 3 linears + layer 0's down_proj)
    deferring["in_scales"].clear()
    materialized = _run(model, deferring, monkeypatch, materialize_here=True)
    assert not any(deferring["in_scales"].values())  # the same consumers, on tensors
    for got, want in zip(deferred, materialized, strict=True):
        assert torch.equal(got, want)
