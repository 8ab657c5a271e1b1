"""GGUF GPU kernels (kernels/gguf_dequant.py, kernels/gguf_gemv.py) against their torch references, and
the references against gguf-py's own dequantizers, on random blocks of every type with a kernel."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.kernels.gguf_dequant import (
    GGUF_BLOCK,
    dequantize_gguf_rows,
    dequantize_packed,
    dequantize_packed_ref,
    repack_gguf_rows,
)
from pagedllm.kernels.gguf_gemv import GGUFGemvConfig, gguf_gemv, gguf_linear, gguf_linear_ref
from tests.kernels.gguf_blocks import random_gguf_blocks

TYPES = sorted(GGUF_BLOCK)


def _packed(qtype: str, n: int, k: int, device, seed: int = 0):
    raw = random_gguf_blocks(qtype, n, k, np.random.default_rng(seed))
    return raw, repack_gguf_rows(torch.from_numpy(raw).to(device), qtype, k)


@pytest.mark.parametrize("qtype", TYPES)
def test_references_equal_gguf_dequantize(qtype):
    """Both torch decoders give gguf-py's fp32 values bit for bit, and the repack keeps every field."""
    n, k = 24, 512
    raw, packed = _packed(qtype, n, k, "cpu")
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    assert np.array_equal(dequantize_gguf_rows(torch.from_numpy(raw), qtype, k).numpy(), expected)
    assert np.array_equal(dequantize_packed_ref(packed).numpy(), expected.T)
    bits = {"Q4_0": 4.5, "Q4_1": 5.0, "Q8_0": 8.5, "Q4_K": 4.625, "Q6_K": 6.5625}[qtype]
    assert packed.nbytes() * 8 == bits * n * k


def test_malformed_rows_are_refused():
    with pytest.raises(ValueError, match="Q4_K rows of 512 inputs"):
        repack_gguf_rows(torch.zeros(4, 100, dtype=torch.uint8), "Q4_K", 512)
    with pytest.raises(ValueError, match="no GPU kernel"):
        repack_gguf_rows(torch.zeros(4, 176, dtype=torch.uint8), "Q5_K", 256)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequant_kernel_is_exact(device, qtype):
    _, packed = _packed(qtype, 40, 256, device)  # 40: a ragged last column block of 64
    assert torch.equal(dequantize_packed(packed, torch.float32), dequantize_packed_ref(packed))


# (m, config): FMA GEMV with the default config; tensor-core GEMV split over K 4 ways (16-deep steps
# for Q6_K, 32 otherwise); the dequantize + matmul path (m 17).
@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize(("m", "split"), [(1, False), (3, True), (17, False)])
def test_linear_matches_reference(device, qtype, m, split):
    n, k = 40, 256
    _, packed = _packed(qtype, n, k, device, seed=m)
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device)
    if split:
        cfg = GGUFGemvConfig(32, 16 if qtype == "Q6_K" else 32, 4, 4, 2)
        out = gguf_gemv(x, packed, bias, cfg)
    else:
        out = gguf_linear(x, packed, bias)
    ref = gguf_linear_ref(x, packed, bias)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
