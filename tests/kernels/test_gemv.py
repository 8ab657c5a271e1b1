"""Skinny GEMM (decode GEMV) kernel against its fp32 reference, on every launch path.

The sm_90 compile of `gemv_config`'s launches (registers, no spills, FMA path off shared memory)
is checked with the other kernels in `test_compile_sm90.py`.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels import gemv
from pagedllm.kernels.gemv import GemvConfig, gemv_config, skinny_linear, skinny_linear_ref, use_skinny_linear

# (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, USE_DOT): FMA and tensor-core inner products,
# each with and without split-K. N=37, K=100 are multiples of neither block, so the last N-block
# and the last K step are ragged; with SPLIT_K=3 and BLOCK_K=16 the splits own 48, 48 and 4 columns.
_CONFIGS = {
    "fma": GemvConfig(8, 32, 1, 4, 2, False),
    "fma_split": GemvConfig(4, 16, 3, 4, 2, False),
    "dot": GemvConfig(16, 32, 1, 4, 2, True),
    "dot_split": GemvConfig(16, 16, 3, 4, 2, True),
}


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, device, bias: bool):
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("path", list(_CONFIGS))
@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_fp32_every_path(device, path, m):
    x, w, b = _inputs(m, 37, 100, torch.float32, device, bias=m % 2 == 1)
    out = skinny_linear(x, w, b, config=_CONFIGS[path])
    assert out.shape == (m, 37) and out.dtype == torch.float32
    torch.testing.assert_close(out, skinny_linear_ref(x, w, b), atol=1e-5, rtol=1e-5)
    # The reference against the plain formula, so it cannot drift.
    expected = x @ w.T + (b if b is not None else 0)
    torch.testing.assert_close(skinny_linear_ref(x, w, b), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["fma_split", "dot"])
def test_half_precision(device, dtype, path):
    if device.type == "cpu" and dtype == torch.bfloat16 and _CONFIGS[path].USE_DOT:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (garbage ~1e10); runs on GPU")
    x, w, b = _inputs(3, 37, 100, dtype, device, bias=True)
    out = skinny_linear(x, w, b, config=_CONFIGS[path])
    assert out.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), skinny_linear_ref(x, w, b).float(), atol=tol, rtol=tol)


def test_split_k_counters_reset_and_deterministic(device):
    # The last program of each N-block zeroes its counter, so back-to-back calls stay correct and
    # (partials summed in split order) bit-identical.
    x, w, b = _inputs(2, 37, 100, torch.float32, device, bias=False)
    first = skinny_linear(x, w, b, config=_CONFIGS["dot_split"])
    second = skinny_linear(x, w, b, config=_CONFIGS["dot_split"])
    assert torch.equal(first, second)
    assert not gemv._workspaces[x.device][1].any()


def test_default_config_and_strided_inputs(device):
    # A column slice of x (row stride 130) and rows of a bigger weight, through gemv_config's choice.
    x_full, w_full, _ = _inputs(2, 80, 130, torch.bfloat16, device, bias=False)
    x, w = x_full[:, :96], w_full[:50, :96]
    out = skinny_linear(x, w)
    torch.testing.assert_close(out.float(), skinny_linear_ref(x, w).float(), atol=2e-2, rtol=2e-2)


def test_gemv_config_follows_the_h200_sweep():
    # Many small programs, whole 16-byte vectors per thread on the FMA path, no split-K by default.
    for m, n, k in [(1, 4096, 1024), (1, 1024, 3072), (2, 28672, 4096), (4, 1024, 2048), (8, 1024, 2048),
                    (8, 151936, 1024), (16, 4096, 4096)]:
        cfg = gemv_config(m, n, k)
        assert cfg.SPLIT_K == 1, cfg
        assert cfg.USE_DOT == (m > 8 or (m >= 3 and n >= 65536)), (m, n, cfg)
        if not cfg.USE_DOT:  # one bf16 vector per thread and row per step: no shuffles in the loop
            assert cfg.BLOCK_K == 8 * 32 * cfg.num_warps, cfg
    assert gemv_config(1, 1024, 2048).BLOCK_N == 1  # 3.2 us vs cuBLAS 12.7 us on the H200
    assert gemv_config(1, 28672, 4096).BLOCK_N == 2
    assert gemv_config(2, 128256, 4096).BLOCK_N == 8
    assert gemv_config(1, 4096, 256) == GemvConfig(2, 256, 1, 1, 1, False)  # short K: fewer warps


def test_use_skinny_linear_rule():
    assert use_skinny_linear(1, 4096, 1024, torch.bfloat16)
    assert use_skinny_linear(8, 1024, 2048, torch.float16)
    assert not use_skinny_linear(9, 4096, 1024, torch.bfloat16)  # batch large enough for cuBLAS
    assert not use_skinny_linear(4, 28672, 4096, torch.bfloat16)  # measured: cuBLAS 56 us vs 64
    assert use_skinny_linear(4, 128256, 4096, torch.bfloat16)  # LM head: 240 us vs 248
    assert not use_skinny_linear(1, 4096, 1024, torch.float32)
    assert not use_skinny_linear(1, 64, 64, torch.bfloat16)  # too small to matter
    assert not use_skinny_linear(1, 4096, 1020, torch.bfloat16)  # rows not 16-byte aligned


def test_rejects_bad_input(device):
    x, w, _ = _inputs(2, 8, 16, torch.float32, device, bias=False)
    with pytest.raises(ValueError, match="K=16"):
        skinny_linear(x, w[:, :8])
    with pytest.raises(ValueError, match="rows"):
        skinny_linear(torch.randn(17, 16, device=device), w)
    with pytest.raises(ValueError, match="dtype"):
        skinny_linear(x.half(), w)

