"""Tiny FP8 MoE checkpoints (Mixtral, Qwen3-MoE) in vLLM's / AutoFP8's "fp8" layout, and the
transformers model on the weights pagedllm computes with, dequantized (fp32).

Layout written (what AutoFP8 writes for Mixtral-8x7B-Instruct-v0.1-FP8): every expert projection
and attention linear `...{name}.weight` float8_e4m3fn with `.weight_scale` () fp32 (per tensor),
and for activation_scheme "static" `.input_scale` (); the router gate, norms, embeddings and the
LM head stay fp32; config.json `quantization_config {"quant_method": "fp8", "activation_scheme": ...}`.

The dequantized reference follows the rules of pagedllm/quantization/fp8_moe.py, computed here on
their own: an expert's w1 / w3 requantized to the larger of their two scales; online FP8 one scale
over the expert's [w1; w3] and one over w2, the linears per output channel (as quant_ckpt.py).
"""

from __future__ import annotations

import json
import re

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from tests.quantization.quant_ckpt import _input_amax, _tmpdir

FP8 = torch.float8_e4m3fn
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_ATTN = re.compile(r"\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
_UP_OF = {"w1": "w3", "gate_proj": "up_proj"}  # the gate projection -> its up projection


def tiny_moe(arch: str) -> nn.Module:
    """A tiny random fp32 MoE model with fidelity-style weights (quant_ckpt.fidelity_model: std 0.03 in
    the decoder layers, 0.5 in the embedding, LM head and router, so greedy tokens and routing are not
    decided by near-ties)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    from tests.models.greedy_check import TINY

    if arch == "mixtral":
        config = MixtralConfig(**TINY, num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(**TINY, head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                norm_topk_prob=True, architectures=["Qwen3MoeForCausalLM"])
    else:
        raise ValueError(f"unknown tiny MoE {arch!r}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                wide = "embed" in name or "lm_head" in name or name.endswith("mlp.gate.weight")
                p.normal_(0, 0.5 if wide else 0.03)
    return model


def _state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's checkpoint as transformers writes it (per-expert tensors) and its config.json."""
    path = _tmpdir("moe-src")
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors")), json.loads((path / "config.json").read_text())


def _write(state: dict[str, torch.Tensor], config: dict, tag: str) -> str:
    path = _tmpdir(tag)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return str(path)


def _reference(state: dict[str, torch.Tensor], config: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    return AutoModelForCausalLM.from_pretrained(_write(state, config, "moe-ref"), dtype=torch.float32).eval()


def _quant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.float() / scale).clamp(-448, 448).to(FP8)


def fp8_moe_checkpoint(model: nn.Module, static: bool, attention: bool = True) -> tuple[str, nn.Module]:
    """(checkpoint dir, transformers model on its dequantized weights) for `model`. attention=False:
    only the experts are FP8, the attention linears listed in `ignored_layers` (the reference is then
    exact without activation hooks)."""
    state, config = _state(model)
    amax = _input_amax(model, None) if static else {}
    ckpt, deq = dict(state), dict(state)
    gen = torch.Generator().manual_seed(1)
    for name, w in state.items():
        if not (_EXPERT.search(name) or (attention and _ATTN.search(name))):
            continue
        scale = (w.float().abs().amax() / 448.0).reshape(())
        ckpt[name], ckpt[name.replace(".weight", ".weight_scale")] = _quant(w, scale), scale
        deq[name] = ckpt[name].float() * scale
        if static:
            module = name.removesuffix(".weight")
            # Experts: a made-up calibration (unused by the W8A16 experts, loaded and checked); a
            # different one per expert and projection, so the loader's largest-one rule is exercised.
            value = amax[module] / 448.0 if module in amax else 0.01 * (1 + torch.rand((), generator=gen))
            ckpt[f"{module}.input_scale"] = torch.as_tensor(value, dtype=torch.float32).reshape(())
    for name in state:  # w1 / w3 on the larger of their two scales, per expert
        m = _EXPERT.search(name)
        if not m or m[2] not in _UP_OF:
            continue
        up = name.replace(f".{m[2]}.weight", f".{_UP_OF[m[2]]}.weight")
        scales = {n: ckpt[n.replace(".weight", ".weight_scale")] for n in (name, up)}
        top = torch.maximum(*scales.values())
        for n, s in scales.items():
            deq[n] = (ckpt[n].float() * (s / top)).clamp(-448, 448).to(FP8).float() * top
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if static else "dynamic"}
    if not attention:
        config["quantization_config"]["ignored_layers"] = [r"re:.*\.self_attn\..*"]
    ref = _reference(deq, config)
    ref.static_input_scales = {n.removesuffix(".input_scale"): float(t) for n, t in ckpt.items()
                               if n.endswith(".input_scale") and _ATTN.search(n.replace(".input_scale", ".weight"))}
    return _write(ckpt, config, f"moe-fp8-{'static' if static else 'dynamic'}"), ref


def online_moe_checkpoint(model: nn.Module) -> tuple[str, nn.Module]:
    """A bf16 checkpoint of `model` (for `quantization="fp8"`) and transformers on the weights online FP8
    computes with: experts e4m3 with one scale per expert and GEMM, the attention linears per channel."""
    state, config = _state(model)
    state = {k: v.to(torch.bfloat16) for k, v in state.items()}
    config["dtype"] = "bfloat16"
    deq = {k: v.float() for k, v in state.items()}
    for name, w in deq.items():
        m = _EXPERT.search(name)
        if m and m[2] in _UP_OF:
            up = name.replace(f".{m[2]}.weight", f".{_UP_OF[m[2]]}.weight")
            scale = (torch.cat([w, deq[up]]).abs().amax() / 448.0).clamp(min=1e-12)
            deq[name] = _quant(w, scale).float() * scale
            deq[up] = _quant(deq[up], scale).float() * scale
        elif m and m[2] in ("w2", "down_proj"):
            scale = (w.abs().amax() / 448.0).clamp(min=1e-12)
            deq[name] = _quant(w, scale).float() * scale
        elif _ATTN.search(name):
            scale = (w.abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
            deq[name] = _quant(w, scale).float() * scale
    return _write(state, config, "moe-bf16"), _reference(deq, config)
