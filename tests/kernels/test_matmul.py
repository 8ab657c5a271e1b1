"""Tile GEMM kernel against its fp32 reference, on every launch path (split or not, ragged or not)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import matmul
from pagedllm.kernels.matmul import MatmulConfig, tile_linear, tile_linear_ref, use_tile_linear

# M=37, N=45, K=100: multiples of no block, so the last row and column tiles wrap and the last K
# step is ragged (K % BLOCK_K != 0); K=96 is the even path. GROUP_M=2 with 3 row tiles leaves a
# short last group. SPLIT_K=3 with BLOCK_K=16 over K=100 splits 48 / 48 / 4.
_CONFIGS = {
    "plain": MatmulConfig(16, 16, 32, 1, 4, 2, GROUP_M=2),
    "split": MatmulConfig(16, 32, 16, 3, 4, 2, GROUP_M=2),
}


@pytest.mark.parametrize("path", list(_CONFIGS))
@pytest.mark.parametrize("k", [100, 96])
def test_fp32_every_path(device, path, k):
    x = torch.randn(37, k, device=device)
    w = torch.randn(45, k, device=device) / k**0.5
    for b in (None, torch.randn(45, device=device)):
        out = tile_linear(x, w, b, config=_CONFIGS[path])
        assert out.shape == (37, 45) and out.dtype == torch.float32
        torch.testing.assert_close(out, tile_linear_ref(x, w, b), atol=1e-5, rtol=1e-5)
    # The reference against the plain formula, so it cannot drift.
    torch.testing.assert_close(tile_linear_ref(x, w, b), x @ w.T + b, atol=1e-5, rtol=1e-5)


def test_half_precision_and_strided_input(device):
    # fp16 (the interpreter's bf16 tl.dot is wrong; bf16 runs on the GPU): a column slice of a
    # wider tensor as x, as a fused projection's output would be.
    wide = torch.randn(20, 160, device=device).half()
    x = wide[:, 32:96]
    w = (torch.randn(24, 64, device=device) / 8).half()
    out = tile_linear(x, w, None, config=_CONFIGS["split"])
    torch.testing.assert_close(out.float(), tile_linear_ref(x, w).float(), atol=2e-3, rtol=2e-3)


def test_split_sum_is_deterministic(device):
    x = torch.randn(17, 100, device=device)
    w = torch.randn(45, 100, device=device)
    first = tile_linear(x, w, config=_CONFIGS["split"])
    assert torch.equal(first, tile_linear(x, w, config=_CONFIGS["split"]))


def test_bad_inputs_are_named(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="K=8"):
        tile_linear(x, torch.randn(3, 9, device=device))
    with pytest.raises(ValueError, match="bias must have shape"):
        tile_linear(x, torch.randn(3, 8, device=device), torch.randn(4, device=device))
    with pytest.raises(ValueError, match="dtype mismatch"):
        tile_linear(x, torch.randn(3, 8, device=device).half())


def test_dispatch_follows_the_tuned_table(monkeypatch):
    cfg = MatmulConfig(64, 128, 64, 1, 4, 3)
    monkeypatch.setattr(matmul, "_TUNED", {(4096, 4096): [(64, None), (256, cfg)]})
    bf16 = torch.bfloat16
    assert not use_tile_linear(48, 4096, 4096, bf16)  # cuBLAS won at this batch size
    assert use_tile_linear(200, 4096, 4096, bf16) and matmul.matmul_config(200, 4096, 4096) == cfg
    assert not use_tile_linear(300, 4096, 4096, bf16)  # past the last tuned batch size
    assert not use_tile_linear(200, 4096, 4096, torch.float32)  # fp32 stays with cuBLAS
    assert not use_tile_linear(200, 1024, 4096, bf16)  # shape never tuned
