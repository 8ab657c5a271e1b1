"""The one-dot-a-step int4 GEMM (kernels/wna16_mma.py) against the fp32 reference: zero points, bias,
act-order (x gathered by perm), split-K, ragged M and N blocks, groups of 128 and 256; fp32 and fp16
activations in the interpreter (its USE_ASM=False path), the inline-PTX dequantization on a GPU; and
the dispatch's table / rule."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.kernels import wna16_mma_config
from pagedllm.kernels.launch_table import read_launch_table
from pagedllm.kernels.wna16_gemm import wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_mma import wna16_mma_linear
from pagedllm.kernels.wna16_mma_config import MMAConfig, mma_choice, mma_rule
from tests.kernels.test_wna16_tc import _weights  # the int4 g-group weights of every int4 kernel test

# (m, k, group, config): one tile; two M blocks and a ragged one with K split 2 ways; K split 4 ways
# over groups of 256 (two steps a group: the scale / zero point prefetch crosses no group edge).
CASES = [(16, 256, 128, MMAConfig(16, 64, 1, 4, 2)), (40, 512, 128, MMAConfig(16, 64, 2, 4, 3)),
         (5, 1024, 256, MMAConfig(16, 64, 4, 4, 2))]


@pytest.mark.parametrize(("m", "k", "group", "config"), CASES)
def test_mma_kernel_matches_reference(device, m, k, group, config):
    n = 144  # not a multiple of BLOCK_N: ragged last block
    qweight, scales, zeros = _weights(k, n, group, device)
    perm = torch.randperm(k, device=device).to(torch.int32)
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device)
    for p in (None, perm):
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group, perm=p, bias=bias)
        out = wna16_mma_linear(x, qweight, scales, zeros, group, bias=bias, perm=p, config=config, use_asm=False)
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_mma_kernel_16bit(device):
    """16-bit x: the weights rounded once to x's dtype as (q - z) * s (fp16 in the interpreter; bf16 and
    the PTX dequantization on a GPU), then fp32 accumulation."""
    k, n, group = 256, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float16,)
    for dtype in dtypes:
        x = torch.randn(24, k, device=device).to(dtype)
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group).float()
        out = wna16_mma_linear(x, qweight, scales, zeros, group, config=MMAConfig(16, 64, 2, 4, 2)).float()
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_mma_errors_name_the_problem(device):
    qweight, scales, zeros = _weights(256, 64, 128, device)
    with pytest.raises(ValueError, match="must divide the group size"):
        wna16_mma_linear(torch.randn(20, 256, device=device), qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="x has 128 inputs, the packed weight 256"):
        wna16_mma_linear(torch.randn(20, 128, device=device), qweight, scales, zeros, 128)


def test_choice_rule_table_and_file(tmp_path, monkeypatch, device):
    # the measured table holds the 8B shapes (its picks are the sweep's); past its buckets the path before
    assert mma_choice(100, 4096, 14336) in {c for _, c in wna16_mma_config.TABLE[(4096, 14336)]} - {None}
    assert mma_choice(4096, 28672, 4096) is None
    # the rule for other shapes: 16-row tiles up to 16 rows, K split 4 ways for few column blocks;
    # narrow shapes past 256 rows and wide ones past 1024: None
    assert mma_choice(8, 5120, 5120) == mma_rule(8, 5120, 5120) == MMAConfig(16, 64, 4, 4, 3)
    assert mma_rule(300, 5120, 5120) is None and mma_rule(300, 20480, 5120) == MMAConfig(256, 128, 1, 8, 3)
    assert mma_rule(2000, 20480, 5120) is None
    # a table replaces the rule for its shapes: buckets by max rows, None = the path before
    table = {(64, 256): ((32, MMAConfig(16, 64, 2, 4, 2)), (64, None))}
    monkeypatch.setattr(wna16_mma_config, "TABLE", table)
    assert mma_choice(20, 64, 256) == MMAConfig(16, 64, 2, 4, 2)
    assert mma_choice(50, 64, 256) is None and mma_choice(500, 64, 256) is None
    # the dispatch follows it: 20 rows through this kernel, 50 through the path before, both right
    qweight, scales, zeros = _weights(256, 64, 128, device)
    for m in (20, 50):
        x = torch.randn(m, 256, device=device)
        torch.testing.assert_close(wna16_linear(x, qweight, scales, zeros, 4, 128),
                                   wna16_linear_ref(x, qweight, scales, zeros, 4, 128), atol=1e-3, rtol=1e-3)
    # PAGEDLLM_WNA16_MMA_TABLE's file form, and a malformed one named
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"64,256": [[64, None], [32, [16, 64, 2, 4, 2]]]}))
    assert read_launch_table(str(f), MMAConfig, "PAGEDLLM_WNA16_MMA_TABLE") == table
    f.write_text(json.dumps({"64x256": [[32, None]]}))
    with pytest.raises(ValueError, match="PAGEDLLM_WNA16_MMA_TABLE=.*not a table"):
        read_launch_table(str(f), MMAConfig, "PAGEDLLM_WNA16_MMA_TABLE")


def test_act_order_few_rows_stay_on_the_tc_kernel(monkeypatch, device):
    """Act-order batches of <= 16 rows keep the tensor-core kernel (x read through perm in the kernel);
    more rows take the GEMM (x gathered once); both equal the reference."""
    from pagedllm.kernels import wna16_gemm

    calls = []
    real = wna16_gemm.wna16_mma_linear
    monkeypatch.setattr(wna16_gemm, "wna16_mma_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    qweight, scales, zeros = _weights(256, 64, 128, device)
    perm = torch.randperm(256, device=device).to(torch.int32)
    for m in (8, 24):
        x = torch.randn(m, 256, device=device)
        torch.testing.assert_close(wna16_linear(x, qweight, scales, zeros, 4, 128, perm=perm),
                                   wna16_linear_ref(x, qweight, scales, zeros, 4, 128, perm=perm), atol=1e-3, rtol=1e-3)
    assert calls == [24]
