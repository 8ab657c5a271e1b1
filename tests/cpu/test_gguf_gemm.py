"""GEMM on GGUF blocks: the repacked Q4_0 / Q4_1 / Q8_0 weights give the dequantized float32 checkpoint
bit for bit, and products agree with a dense float32 matmul to float32 rounding, for every row count
(block kernel up to 48 rows, dequantized panels + BLAS above) and output counts that are not multiples of 16."""

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from pagedllm.cpu.gguf_gemm import gguf_dequantize, gguf_matmul, pack_gguf_rows

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def quantized(qtype: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    dense = torch.from_numpy(quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float32))
    return raw, dense


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("n,k", [(48, 64), (50, 96), (7, 32)])
def test_dequantize_is_bit_exact(cpu_kernels, qtype, n, k):
    raw, dense = quantized(qtype, n, k)
    assert torch.equal(gguf_dequantize(pack_gguf_rows(raw, qtype, k)), dense)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("m,n", [(1, 50), (2, 50), (3, 50), (4, 50), (5, 50), (16, 50), (17, 50), (33, 50), (70, 50), (300, 600)])
def test_matmul_matches_dense_float32(cpu_kernels, qtype, m, n):
    # (300, 600): panels of 256 rows (the last one partial, 600 % 16 != 0) x row blocks of 128
    k = 160
    raw, dense = quantized(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = gguf_matmul(x, pack_gguf_rows(raw, qtype, k))
    ref = x.double() @ dense.double().T
    assert y.shape == (m, n) and y.dtype == torch.float32
    # float32 sums of 160 products of O(1) values: a few ulp of the result's scale
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * ref.abs().max().item())


def test_strided_rows_and_out_buffer(cpu_kernels):
    raw, dense = quantized("Q4_1", 32, 64)
    packed = pack_gguf_rows(raw, "Q4_1", 64)
    big = torch.randn(3, 100)
    x = big[:, 10:74]  # rows 100 floats apart
    out = torch.full((3, 32), float("nan"))
    assert gguf_matmul(x, packed, out) is out
    torch.testing.assert_close(out, x @ dense.T, rtol=1e-5, atol=1e-5)


def test_bad_inputs_are_refused(cpu_kernels):
    raw, _ = quantized("Q8_0", 16, 64)
    packed = pack_gguf_rows(raw, "Q8_0", 64)
    with pytest.raises(ValueError, match="float32"):
        gguf_matmul(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"\(M, 64\)"):
        gguf_matmul(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="no CPU kernel"):
        pack_gguf_rows(raw, "Q6_K", 64)
    with pytest.raises(ValueError, match="multiple of the GGUF block size"):
        pack_gguf_rows(raw, "Q8_0", 48)
    with pytest.raises(ValueError, match="bytes"):
        pack_gguf_rows(raw[:, :30], "Q8_0", 64)
