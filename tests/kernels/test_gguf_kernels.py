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
def test_kernels_match_reference(device, qtype):
    """The fp32 dequantization kernel (bit for bit), the FMA GEMV (M 1: the default config, and the
    factored-scales variant split over K with the next step prefetched; M 3: rows padded to 4, split,
    prefetched) and the tensor-core GEMV split over K (M 6) on one weight (24 x 256: a ragged column
    block, two K steps)."""
    n, k = 24, 256
    _, packed = _packed(qtype, n, k, device, seed=1)
    assert torch.equal(dequantize_packed(packed, torch.float32), dequantize_packed_ref(packed))
    bias = torch.randn(n, device=device)
    for m, cfg in ((1, None), (1, GGUFGemvConfig(16, 8, 2, 4, 2, FACTORED=True, PREFETCH=True)),
                   (3, GGUFGemvConfig(16, 8, 2, 4, 2, PREFETCH=True)), (6, GGUFGemvConfig(32, 16, 2, 4, 2))):
        x = torch.randn(m, k, device=device)
        out = gguf_linear(x, packed, bias) if cfg is None else gguf_gemv(x, packed, bias, cfg)
        ref = gguf_linear_ref(x, packed, bias)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_k_not_a_multiple_of_the_step(device):
    """K = 96 (three 32-value blocks; SmolLM2's 576 is 4.5 steps of 128): the step's tail is masked, in
    the GEMV (M 1, 2: FMA; 33: tensor cores, 64 rows a tile) and in the dequantize + matmul path (M 17)."""
    _, packed = _packed("Q4_1", 24, 96, device, seed=5)
    assert torch.equal(dequantize_packed(packed, torch.float32), dequantize_packed_ref(packed))
    for m in (1, 2, 17, 33):
        x = torch.randn(m, 96, device=device)
        ref = gguf_linear_ref(x, packed)
        out = gguf_gemv(x, packed) if m == 33 else gguf_linear(x, packed)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    # the scratch path in column chunks: 200 columns as chunks of 128 (the smallest chunk)
    _, wide = _packed("Q8_0", 200, 96, device, seed=6)
    x = torch.randn(17, 96, device=device)
    ref = gguf_linear_ref(x, wide)
    torch.testing.assert_close(gguf_linear(x, wide, scratch_bytes=1), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
