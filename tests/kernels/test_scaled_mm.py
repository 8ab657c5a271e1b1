"""W8A8 (FP8 e4m3 and INT8) GEMM: the Triton kernel against `scaled_mm_ref`, the reference against a
plain fp32 matmul of the dequantized operands, and the activation quantizers' contracts."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.scaled_mm import (
    FP8_DTYPE,
    PATHS,
    choose_path,
    quantize_activation,
    scaled_gemm_triton,
    scaled_mm_ref,
    w8a8_linear,
)
from pagedllm.kernels.w8a16_gemv import w8a16_linear_ref


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize(("m", "block"), [(1, (16, 64, 128)), (5, (16, 32, 32)), (37, (32, 64, 64))])
def test_triton_matches_reference(device, qdtype, m, block):
    k, n = 200, 72  # neither a multiple of the blocks
    x = torch.randn(m, k, device=device)
    w = torch.randn(n, k, device=device) * 0.05
    wq, ws = quantize_activation(w, qdtype)  # one scale per output channel
    xq, xs = quantize_activation(x, qdtype)
    bias = torch.randn(n, device=device)
    ref = scaled_mm_ref(xq, wq, xs, ws.flatten(), bias, torch.float32)
    dense = (xq.float() * xs) @ (wq.float() * ws).t() + bias
    torch.testing.assert_close(ref, dense, atol=1e-4, rtol=1e-4)
    out = scaled_gemm_triton(xq, wq, xs, ws.flatten(), bias, torch.float32, block=block)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # The quantization error itself is what W8A8 costs: a few percent of the output's scale.
    assert (ref - (x @ w.t() + bias)).abs().max() < 0.1 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
def test_activation_quantization(qdtype):
    x = torch.tensor([[1.0, -2.0, 0.5], [100.0, 3.0, -50.0]])
    xq, scale = quantize_activation(x, qdtype)
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    torch.testing.assert_close(scale, torch.tensor([[2.0], [100.0]]) / qmax)
    assert xq.dtype == qdtype and xq.float().abs().amax(1).tolist() == [qmax, qmax]
    # A static scale clamps what does not fit instead of growing.
    xq, scale = quantize_activation(x, qdtype, torch.tensor(0.5 / qmax))
    lo = -128.0 if qdtype == torch.int8 else -qmax  # int8's range is [-128, 127]
    assert scale.shape == (2, 1) and xq.float().min() == lo and xq.float().max() == qmax


def test_w8a8_linear_cpu_path_keeps_leading_dims():
    x = torch.randn(2, 3, 16)
    w = torch.randn(8, 16)
    wq, ws = quantize_activation(w, FP8_DTYPE)
    out = w8a8_linear(x, wq, ws.flatten(), None, None)
    assert out.shape == (2, 3, 8) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w.t(), atol=0.5, rtol=0.1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm / _int_mm need CUDA")
@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 5, 40, 300])
@pytest.mark.parametrize("path", [None, *PATHS])
def test_w8a8_linear_cuda_paths_and_graph_capture(qdtype, m, path):
    k, n = 256, 96  # multiples of 16: the cuBLAS paths (M padded for _int_mm)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wq, ws = quantize_activation(torch.randn(n, k, device="cuda") * 0.05, qdtype)
    ws = ws.flatten()
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    taken = path or choose_path(m, n, k, qdtype)
    if taken == "w8a16" and m <= 64:  # weight-only: the activations are not quantized
        ref = w8a16_linear_ref(x.float(), wq, ws, bias.float())
    else:
        xq, xs = quantize_activation(x, qdtype)
        ref = scaled_mm_ref(xq, wq, xs, ws, bias, torch.float32)
    out = w8a8_linear(x, wq, ws, None, bias, path=path)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=2e-2 * ref.abs().max().item(), rtol=2e-2)
    graph = torch.cuda.CUDAGraph()  # no host syncs: the same call captures and replays
    with torch.cuda.graph(graph):
        captured = w8a8_linear(x, wq, ws, None, bias, path=path)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(captured, w8a8_linear(x, wq, ws, None, bias, path=path), atol=0, rtol=0)


def test_decode_table_dispatch(monkeypatch):
    # PAGEDLLM_W8A8_SPLIT_K (on): FP8 linears of the table's shapes take its measured pick at 17-256 rows;
    # off, or INT8, or another shape: the M thresholds (Triton up to 64 rows, FP8 cuBLAS above).
    import pagedllm.kernels.scaled_mm as sm
    from pagedllm.kernels.w8a8_gemm import DECODE_TABLE, W8A8Config

    monkeypatch.setattr(sm, "SPLIT_K", True)
    assert choose_path(128, 4096, 14336, FP8_DTYPE) == "triton"  # down at 97-160 rows: the unsplit 64 x 64 tile
    assert sm.triton_config(128, 4096, 14336, FP8_DTYPE) == W8A8Config(64, 64, 256, 8, 4, 4)
    assert sm.triton_config(200, 4096, 14336, FP8_DTYPE) == W8A8Config(64, 128, 128, 8, 4, 4, True, 2, True)
    assert choose_path(200, 6144, 4096, FP8_DTYPE) == "cublas"  # qkv from 161 rows: cuBLAS was faster
    assert choose_path(80, 28672, 4096, FP8_DTYPE) == "triton"  # gate_up up to 96 rows, then cuBLAS
    assert choose_path(128, 28672, 4096, FP8_DTYPE) == "cublas"
    assert choose_path(300, 4096, 14336, FP8_DTYPE) == "cublas"  # past the table
    assert choose_path(128, 4096, 14336, torch.int8) == "triton"  # INT8: its own thresholds
    assert sm.triton_config(128, 4096, 14336, torch.int8) == sm.w8a8_gemm_config(128, 4096, 14336)
    assert choose_path(100, 2048, 2048, FP8_DTYPE) == "cublas"  # a shape the table lacks
    assert choose_path(8, 4096, 4096, FP8_DTYPE) == "w8a16"
    for buckets in DECODE_TABLE.values():  # buckets ascend and end at 256 rows
        assert [b for b, _ in buckets] == sorted(b for b, _ in buckets) and buckets[-1][0] == 256
    monkeypatch.setattr(sm, "SPLIT_K", False)
    assert choose_path(128, 4096, 14336, FP8_DTYPE) == "cublas"
    assert choose_path(40, 4096, 14336, FP8_DTYPE) == "triton"
    assert sm.triton_config(40, 4096, 14336, FP8_DTYPE) == sm.w8a8_gemm_config(40, 4096, 14336)
