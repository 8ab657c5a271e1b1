"""scripts/gpu_fp8_w1_ab.py's run specs (a switch's value may hold commas: PAGEDLLM_FP8_DEFER_LINEARS) and its
check of the deferred scales' qkv / gate_up consumers, on small shapes in the interpreter (the script runs it at
Llama-3.1-8B's on the GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

_SPEC = importlib.util.spec_from_file_location("gpu_fp8_w1_ab",
                                               Path(__file__).resolve().parents[2] / "scripts" / "gpu_fp8_w1_ab.py")
ab = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(ab)


def test_a_switch_value_may_hold_commas():
    assert ab.parse_run("q:PAGEDLLM_FP8_DEFER_SCALES=1,PAGEDLLM_FP8_DEFER_LINEARS=qkv,gate_up:--kv-cache-dtype=fp8") == (
        "q", {"PAGEDLLM_FP8_DEFER_SCALES": "1", "PAGEDLLM_FP8_DEFER_LINEARS": "qkv,gate_up"}, ["--kv-cache-dtype=fp8"])
    assert ab.parse_run("m:PAGEDLLM_FP8_KV_DOTS=0,PAGEDLLM_FUSED_ACT_QUANT=0") == (
        "m", {"PAGEDLLM_FP8_KV_DOTS": "0", "PAGEDLLM_FUSED_ACT_QUANT": "0"}, [])
    assert ab.parse_run("fp8") == ("fp8", {}, [])


def test_the_consumer_check_finds_them_bitwise_equal():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = ab.check_defer_consumers(device, m=3, inter=64, heads=(4, 2, 32))
    assert out == "qkv / gate_up consumers at M=3: silu bitwise equal, prep bitwise equal, decode bitwise equal"
