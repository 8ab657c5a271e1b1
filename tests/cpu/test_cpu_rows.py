"""Row kernels behind the layers on float32 CPU tensors: rotary is bit-exact with the torch formula,
RMSNorm and silu*mul agree to float32 rounding, greedy argmax is torch.argmax (first max, NaN wins)."""

import pytest
import torch
import torch.nn.functional as F

import pagedllm.layers.activation as activation
import pagedllm.layers.layernorm as layernorm
import pagedllm.layers.rotary_embedding as rotary
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.rotary_embedding import get_rope
from pagedllm.sample.sampler import greedy_argmax


def torch_path(monkeypatch, module):
    monkeypatch.setattr(module, "load_cpu_kernels", lambda: None)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_rotary_bit_exact(cpu_kernels, monkeypatch, neox, rotary_fraction):
    rope = get_rope(64, 4096, {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary_fraction},
                    is_neox_style=neox)
    qkv = torch.randn(7, 16 * 64)
    q, k, _ = qkv.split([8 * 64, 4 * 64, 4 * 64], dim=-1)
    pos = torch.tensor([0, 1, 5, 100, 4095, 7, 2])
    fast = rope(pos, q, k)
    torch_path(monkeypatch, rotary)
    ref = rope(pos, q, k)
    assert torch.equal(fast[0], ref[0]) and torch.equal(fast[1], ref[1])


def test_rmsnorm_close(cpu_kernels, monkeypatch):
    norm = RMSNorm(200, eps=1e-5)
    norm.weight.data = torch.randn(200)
    x, r = torch.randn(5, 200) * 3, torch.randn(5, 200)
    fast, fast_res = norm(x, r)
    fast_plain = norm(x)
    torch_path(monkeypatch, layernorm)
    ref, ref_res = norm(x, r)
    assert torch.equal(fast_res, ref_res)  # the residual sum is one rounding either way
    torch.testing.assert_close(fast, ref, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(fast_plain, norm(x), rtol=2e-6, atol=2e-6)


def test_silu_and_mul_close(cpu_kernels, monkeypatch):
    x = torch.randn(6, 2 * 70) * 8  # 70: a tail past the 16-lane vectors
    fast = SiluAndMul()(x)
    torch_path(monkeypatch, activation)
    torch.testing.assert_close(fast, F.silu(x[:, :70]) * x[:, 70:], rtol=2e-6, atol=1e-6)


def test_greedy_argmax_is_torch_argmax(cpu_kernels):
    x = torch.randn(5, 1000)
    x[1, 10] = x[1, 900] = 50.0  # tie: the first index
    x[2, 33] = float("inf")
    x[3, 7] = x[3, 600] = float("nan")  # NaN counts as the largest, first one wins
    x[4] = -float("inf")
    assert greedy_argmax(x).tolist() == x.argmax(dim=-1).tolist() == [int(x[0].argmax()), 10, 33, 7, 0]
    view = x[:, :17]  # rows of a wider buffer
    assert greedy_argmax(view).tolist() == view.argmax(dim=-1).tolist()
