"""The W8A8 tile GEMM (kernels/w8a8_gemm.py) against `scaled_mm_ref`: int8 (exact int32 sums) and fp8,
ragged M / N / K edges, the grouped program order, bias, padded activation rows."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.scaled_mm import FP8_DTYPE, quantize_activation, scaled_mm_ref
from pagedllm.kernels.w8a8_gemm import W8A8Config, w8a8_gemm, w8a8_gemm_config


@pytest.mark.parametrize("qdtype", [torch.int8, FP8_DTYPE], ids=["int8", "fp8"])
@pytest.mark.parametrize(("m", "n", "k", "cfg"), [
    (3, 40, 96, W8A8Config(16, 32, 32, 2, 4, 2)),  # ragged M and N, 3 K steps, 2 column groups
    (37, 64, 80, W8A8Config(16, 32, 64, 2, 4, 2)),  # 3 row blocks in groups of 2; K ragged (80 % 64)
    (37, 40, 80, W8A8Config(16, 32, 32, 2, 4, 2, True)),  # TMA: edges zero-filled by the descriptors
    (37, 40, 224, W8A8Config(16, 32, 32, 2, 4, 2, False, 3)),  # split-K: 7 K steps in slices of 3, 3, 1
    (20, 64, 200, W8A8Config(16, 32, 64, 2, 4, 2, True, 4)),  # split-K asked with TMA: the pointer kernel
    (20, 64, 200, W8A8Config(16, 32, 32, 2, 4, 2, False, 6)),  # 7 steps in slices of 2: the last ragged, two empty
    (37, 40, 224, W8A8Config(16, 32, 32, 2, 4, 2, False, 3, True)),  # one-launch split-K: the last arrival sums
    (20, 64, 200, W8A8Config(16, 32, 32, 2, 4, 2, False, 6, True)),  # ... with two empty slices
    (37, 40, 224, W8A8Config(16, 32, 32, 2, 4, 2, True, 3, True)),  # ... on the TMA kernel, edges zero-filled
])
def test_matches_reference(device, qdtype, m, n, k, cfg):
    x = torch.randn(m, k, device=device) * 2
    w = torch.randn(n, k, device=device) * 0.05
    wq, ws = quantize_activation(w, qdtype)
    xq, xs = quantize_activation(x, qdtype)
    bias = torch.randn(n, device=device)
    ref = scaled_mm_ref(xq, wq, xs, ws.flatten(), bias, torch.float32)
    out = w8a8_gemm(xq, wq, xs, ws.flatten(), bias, torch.float32, config=cfg)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_serial_split_k_counters_reset(device):
    # The one-launch split-K leaves its per-tile counters at zero (the next call, e.g. a graph replay, finds
    # them so) and sums the slices in slice order: two calls give the same bits as each other, and match
    # the reference.
    from pagedllm.kernels import w8a8_gemm as mod

    mod.ensure_workspace(device)
    cfg = W8A8Config(16, 32, 32, 2, 4, 2, False, 4, True)
    xq, xs = quantize_activation(torch.randn(40, 256, device=device), FP8_DTYPE)
    wq, ws = quantize_activation(torch.randn(96, 256, device=device) * 0.05, FP8_DTYPE)
    first = w8a8_gemm(xq, wq, xs, ws.flatten(), None, torch.float32, config=cfg)
    assert int(mod._workspaces[torch.device(device)][1].abs().sum()) == 0
    second = w8a8_gemm(xq, wq, xs, ws.flatten(), None, torch.float32, config=cfg)
    assert torch.equal(first, second)
    torch.testing.assert_close(first, scaled_mm_ref(xq, wq, xs, ws.flatten(), None, torch.float32),
                               atol=1e-4, rtol=1e-4)


def test_padded_rows_and_no_bias(device):
    xq, xs = quantize_activation(torch.randn(8, 64, device=device), torch.int8)
    wq, ws = quantize_activation(torch.randn(32, 64, device=device), torch.int8)
    out = w8a8_gemm(xq, wq, xs, ws.flatten(), None, torch.float32, config=W8A8Config(16, 32, 64, 1, 4, 2), m=5)
    ref = scaled_mm_ref(xq[:5], wq, xs[:5], ws.flatten(), None, torch.float32)
    assert out.shape == (5, 32)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="one dtype"):
        w8a8_gemm(xq, wq.to(FP8_DTYPE), xs, ws.flatten(), None, torch.float32)


def test_config_buckets():
    # The largest tile whose grid fills the SMs; K narrower than BLOCK_K shrinks it (8-bit dots: K >= 32).
    assert w8a8_gemm_config(1, 28672, 4096)[:3] == (16, 128, 128)
    assert w8a8_gemm_config(1, 4096, 4096)[:3] == (16, 64, 256)  # 32 programs of 128 columns: too few
    assert w8a8_gemm_config(2048, 4096, 4096) == W8A8Config(128, 256, 128, 8, 8, 4, True)
    assert w8a8_gemm_config(256, 6144, 4096)[:3] == (64, 128, 128)  # 48 programs of (128, 256)
    assert w8a8_gemm_config(256, 4096, 14336)[:3] == (64, 64, 256)  # 128 of (64, 128), 256 of these
    assert w8a8_gemm_config(1, 64, 40).BLOCK_K == 64
    # split_k: only where the tile leaves SMs idle, slices of >= 4 BLOCK_K steps.
    assert w8a8_gemm_config(64, 4096, 14336, split_k=True) == W8A8Config(64, 128, 128, 8, 4, 4, True, 8, True)
    assert w8a8_gemm_config(128, 6144, 4096, split_k=True).SPLIT_K == 1  # 192 programs of (64, 64)
    assert w8a8_gemm_config(64, 28672, 4096, split_k=True).SPLIT_K == 1
    assert w8a8_gemm_config(8, 4096, 14336, split_k=True).SPLIT_K == 1  # M <= 16 keeps its tiles


@pytest.mark.skipif(not torch.cuda.is_available(), reason="model-sized GEMMs: too slow for the interpreter")
def test_decode_table_configs_match_reference():
    # Every pick of DECODE_TABLE at its bucket's largest and smallest row counts (M % 16 == 0 and != 0: the two
    # compiled forms), on the real Llama-3.1-8B shapes, within 2e-2 of max |ref| (fp8 fast accumulation).
    from pagedllm.kernels.w8a8_gemm import DECODE_MIN_M, DECODE_TABLE, ensure_workspace

    ensure_workspace(torch.device("cuda"))
    for (n, k), buckets in DECODE_TABLE.items():
        wq, ws = quantize_activation(torch.randn(n, k, device="cuda") * 0.05, FP8_DTYPE)
        lo = DECODE_MIN_M
        for max_m, cfg in buckets:
            for m in {lo, max_m}:
                if cfg is None:
                    continue
                xq, xs = quantize_activation(torch.randn(m, k, device="cuda"), FP8_DTYPE)
                ref = scaled_mm_ref(xq, wq, xs, ws.flatten(), None, torch.float32)
                out = w8a8_gemm(xq, wq, xs, ws.flatten(), None, torch.bfloat16, config=cfg)
                err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                assert err < 2e-2, f"{(m, n, k)} {cfg}: {err:.2e}"
            lo = max_m + 1
