from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedllm.layers.layernorm import RMSNorm


def make_pair(hidden: int = 64, eps: float = 1e-5) -> tuple[RMSNorm, LlamaRMSNorm]:
    torch.manual_seed(0)
    ours, ref = RMSNorm(hidden, eps), LlamaRMSNorm(hidden, eps)
    weight = 1 + 0.3 * torch.randn(hidden)
    ours.weight.data.copy_(weight)
    ref.weight.data.copy_(weight)
    return ours, ref


def test_rmsnorm_matches_hf():
    ours, ref = make_pair()
    x = 3 * torch.randn(7, 64)
    torch.testing.assert_close(ours(x), ref(x))
    x3 = torch.randn(7, 4, 64)  # per-head use (Qwen3 q_norm): normalises the last dim only
    torch.testing.assert_close(ours(x3), ref(x3))


def test_fused_residual_add_returns_normed_sum_and_sum():
    ours, ref = make_pair()
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ref(x + residual))


def test_low_precision_input_keeps_its_dtype_and_uses_float32_statistics():
    ours, _ = make_pair()
    ours = ours.to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 100  # x^2 overflows nothing in fp32
    normed, residual = ours(x, x)
    assert normed.dtype == residual.dtype == torch.bfloat16
    expected = (2 * x.float()) * torch.rsqrt((2 * x.float()).pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(normed.float(), (expected.bfloat16() * ours.weight).float())
