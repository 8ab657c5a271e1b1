"""Llama's int4 batch-1 decode fusions (residual add + RMSNorm inside qkv_proj / gate_up_proj's GEMV,
SwiGLU's activation inside down_proj's): the layer plumbing holds the unfused model's logits. The
fused paths run only on a GPU (one row of int4 on the packed fp16 kernel); here the quant method is
told that it fuses one-row inputs on the CPU too, where its fused entry points compute the same
transforms with the references, so what is checked is which norm, residual and activation each
call gets and returns (the kernels themselves: tests/kernels/test_wna16_stream.py)."""

from __future__ import annotations

import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.loader.model_loader import load_model
from pagedllm.quantization.wna16 import WNA16LinearMethod
from tests.models.hf_compare import PagedRunner
from tests.quantization import quant_ckpt as qc


def test_fused_decode_path_keeps_the_logits(monkeypatch):
    ckpt, _ = qc.awq_checkpoint(qc.fidelity_model()[1], 32)
    config = EngineArgs(model=str(ckpt), skip_tokenizer_init=True, quantization="awq").create_engine_config()
    model = load_model(config.model_config, torch.device("cpu"))
    prompt = [17]  # one token: the one-row shape the fusions take
    plain = PagedRunner(model).step({"a": prompt})["a"]
    calls = {"norm": 0, "act": 0}
    apply_rms_norm, apply_silu_and_mul = WNA16LinearMethod.apply_rms_norm, WNA16LinearMethod.apply_silu_and_mul

    def counted(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(WNA16LinearMethod, "fuses_rms_norm", lambda self, layer, x: x.shape[0] == 1)
    monkeypatch.setattr(WNA16LinearMethod, "fuses_silu_and_mul", lambda self, layer, x: x.shape[0] == 1)
    monkeypatch.setattr(WNA16LinearMethod, "apply_rms_norm", counted("norm", apply_rms_norm))
    monkeypatch.setattr(WNA16LinearMethod, "apply_silu_and_mul", counted("act", apply_silu_and_mul))
    fused = PagedRunner(model).step({"a": prompt})["a"]
    layers = config.model_config.hf_config.num_hidden_layers
    # layer 0's input norm has no residual to add (the embeddings): it stays a norm launch
    assert calls == {"norm": 2 * layers - 1, "act": layers}
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
