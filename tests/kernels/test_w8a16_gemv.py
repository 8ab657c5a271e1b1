"""The 8-bit-weight GEMV (kernels/w8a16_gemv.py) against `w8a16_linear_ref`: fp8 and int8 weights,
the FMA (M = 1) and tensor-core paths, split-K, ragged N / K, bias; and w8a8_linear's dispatch."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import scaled_mm
from pagedllm.kernels.scaled_mm import FP8_DTYPE, quantize_activation
from pagedllm.kernels.w8a16_gemv import W8A16Config, w8a16_linear, w8a16_linear_ref


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize(("m", "cfg"), [
    (1, W8A16Config(16, 64, 1, 4, 2, False)),  # FMA, no split
    (1, W8A16Config(16, 32, 32, 4, 2, False)),  # FMA, K split 4 ways
    (5, W8A16Config(32, 32, 16, 4, 2, True)),  # tensor cores, split
])
def test_matches_reference(device, qdtype, m, cfg):
    n, k = 40, 272  # N ragged against BLOCK_N, K not a multiple of BLOCK_K
    x = torch.randn(m, k, device=device)
    wq, ws = quantize_activation(torch.randn(n, k, device=device) * 0.05, qdtype)
    bias = torch.randn(n, device=device)
    ref = w8a16_linear_ref(x, wq, ws.flatten(), bias)
    torch.testing.assert_close(ref, x @ (wq.float() * ws).t() + bias, atol=1e-4, rtol=1e-4)
    out = w8a16_linear(x, wq, ws.flatten(), bias, config=cfg)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    again = w8a16_linear(x, wq, ws.flatten(), bias, config=cfg)  # split-K counters reset themselves
    assert torch.equal(out, again)


def test_dispatch_paths():
    # Small M goes weight-only, larger M to a W8A8 GEMM; a path that is not built is refused.
    assert scaled_mm.choose_path(1, 28672, 4096, FP8_DTYPE) == "w8a16"
    assert scaled_mm.choose_path(8, 4096, 14336, FP8_DTYPE) == "w8a16"
    assert scaled_mm.choose_path(8, 28672, 4096, FP8_DTYPE) == "triton"  # fp8 -> bf16 costs more than quant
    assert scaled_mm.choose_path(8, 28672, 4096, torch.int8) == "w8a16"
    # A shape outside the measured Llama-3.1-8B table (kernels/w8a8_gemm.py DECODE_TABLE): the row thresholds.
    assert scaled_mm.choose_path(64, 5120, 5120, FP8_DTYPE) == "triton"
    assert scaled_mm.choose_path(256, 5120, 5120, FP8_DTYPE) == "cublas"
    # The 8B o_proj at 256 rows: the table's Triton tile (1.11x cuBLAS's row-wise call on the H200, h51).
    assert scaled_mm.choose_path(256, 4096, 4096, FP8_DTYPE) == "triton"
    assert scaled_mm.choose_path(2048, 4096, 4096, torch.int8) == "triton"
    with pytest.raises(ValueError, match="path must be one of"):
        scaled_mm.w8a8_linear(torch.randn(2, 16), torch.zeros(16, 16, dtype=torch.int8), torch.ones(16), None, None,
                              path="nope")
