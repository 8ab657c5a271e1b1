"""The Gluon int4 GEMM (kernels/wna16_wgmma.py): its dequantization arithmetic equals the reference's
weights rounded once (on the CPU, in torch: Gluon has no interpreter), the layout and selector helpers,
the measured table and its file, the dispatch staying off it on the CPU; on an sm_90 GPU the kernel itself
against the fp32 reference (K split, bias, act-order, ragged M and N, fp16). sm90_compile_check.py compiles
its launches for sm_90 in CI, which also proves the words' layout is wgmma's (`assert_trivial`)."""

from __future__ import annotations

import json

import pytest
import torch

from pagedllm.kernels import wna16_gemm, wna16_wgmma_config
from pagedllm.kernels.launch_table import read_launch_table
from pagedllm.kernels.wna16_gemm import dequantize_wna16, wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_wgmma import (
    a_operand_bases,
    wgmma_dequant_emulation,
    wgmma_supported,
    wna16_wgmma_linear,
    word_byte_selectors,
)
from pagedllm.kernels.wna16_wgmma_config import WGMMAConfig, wgmma_choice
from tests.kernels.test_wna16_tc import _weights  # the int4 g-group weights of every int4 kernel test

_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [64, 128])
def test_dequant_arithmetic_is_the_weights_rounded_once(dtype, group):
    """Byte c of each word, the magic pair (OFF + q, OFF + 8 q'), + (-(OFF + z), -(OFF + 8 z)), * (s, s / 8):
    every int4 value and zero point, equal to (q - z) * s rounded once to x's dtype (no ulp off)."""
    k, n = 512, 96
    qweight, scales, zeros = _weights(k, n, group, "cpu")
    zeros[0, :16] = torch.arange(16, dtype=torch.uint8)  # every zero point, against every q below
    scales = scales.to(dtype)
    ref = dequantize_wna16(qweight, scales, zeros, 4, group).to(dtype)
    assert torch.equal(wgmma_dequant_emulation(qweight, scales, zeros, group, dtype), ref)


def test_selectors_and_operand_layout():
    # k % 8 = 5 -> byte 2: the word's byte 2 into byte 0, (word >> 1)'s byte 2 (selector 4 + 2) into byte 2
    assert word_byte_selectors(torch.tensor([0, 1, 5, 7, 13])).tolist() == [0x0400, 0x0400, 0x0602, 0x0703, 0x0602]
    regs, lanes, warps = a_operand_bases(128, 128, 8)
    assert regs == [[0, 1], [8, 0], [0, 8], [0, 16], [0, 32], [0, 64]]
    assert lanes == [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]] and warps == [[16, 0], [32, 0], [64, 0]]
    assert a_operand_bases(128, 64, 4)[0][-1] == [64, 0]  # two 64-row wgmma tiles a warpgroup: a register bit


def test_table_choice_file_and_cpu_dispatch(tmp_path, monkeypatch):
    table = {(64, 256): ((32, WGMMAConfig(16, 64, 2, 4, 4)), (64, None))}
    monkeypatch.setattr(wna16_wgmma_config, "TABLE", table)
    assert wgmma_choice(20, 64, 256) == WGMMAConfig(16, 64, 2, 4, 4)
    assert wgmma_choice(50, 64, 256) is None and wgmma_choice(500, 64, 256) is None
    assert wgmma_choice(20, 128, 256) is None  # a shape not measured: the Triton kernels
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"64,256": [[64, None], [32, [16, 64, 2, 4, 4]]]}))
    assert read_launch_table(str(f), WGMMAConfig, "PAGEDLLM_WNA16_WGMMA_TABLE") == table
    f.write_text(json.dumps({"64,256": [[32, [16, 64]]]}))
    with pytest.raises(ValueError, match="PAGEDLLM_WNA16_WGMMA_TABLE=.*not a table"):
        read_launch_table(str(f), WGMMAConfig, "PAGEDLLM_WNA16_WGMMA_TABLE")
    # off an sm_90 GPU the dispatch never takes it, and the answer is unchanged
    qweight, scales, zeros = _weights(256, 64, 128, "cpu")
    x = torch.randn(20, 256)
    assert not wgmma_supported(x, 256, 128, 4)
    monkeypatch.setattr(wna16_gemm, "_wgmma", lambda: pytest.fail("imported the Gluon kernel on the CPU"))
    torch.testing.assert_close(wna16_linear(x, qweight, scales, zeros, 4, 128),
                               wna16_linear_ref(x, qweight, scales, zeros, 4, 128), atol=1e-3, rtol=1e-3)


def test_errors_name_the_problem():
    qweight, scales, zeros = _weights(256, 64, 128, "cpu")
    with pytest.raises(ValueError, match="must divide the group size"):
        wna16_wgmma_linear(torch.randn(20, 256, dtype=torch.bfloat16), qweight, scales, zeros, 64,
                           WGMMAConfig(16, 64, 1, 4, 3))
    with pytest.raises(ValueError, match="activations must be bfloat16 or float16"):
        wna16_wgmma_linear(torch.randn(20, 256), qweight, scales, zeros, 128, WGMMAConfig(16, 64, 1, 4, 3))
    with pytest.raises(ValueError, match="BLOCK_N must be a multiple of 16 x num_warps"):
        wna16_wgmma_linear(torch.randn(20, 256, dtype=torch.bfloat16), qweight, scales, zeros, 128,
                           WGMMAConfig(16, 64, 1, 8, 3))


# (m, k, group, config): one tile; ragged M over two blocks with K split 2 ways; K split 4 ways over
# groups of 256 with 64-input steps; a 256-row tile on two warpgroups
GPU_CASES = [(16, 256, 128, WGMMAConfig(16, 64, 1, 4, 3)), (40, 512, 128, WGMMAConfig(32, 64, 2, 4, 4)),
             (5, 1024, 256, WGMMAConfig(16, 64, 4, 4, 3, 8)), (300, 512, 128, WGMMAConfig(256, 128, 1, 8, 2))]


@pytest.mark.skipif(not _SM90, reason="wgmma: an sm_90 GPU")
@pytest.mark.parametrize(("m", "k", "group", "config"), GPU_CASES)
def test_kernel_matches_reference_on_sm90(m, k, group, config):
    n = 208  # not a multiple of BLOCK_N: ragged last block
    qweight, scales, zeros = _weights(k, n, group, "cuda")
    perm = torch.randperm(k, device="cuda").to(torch.int32)
    bias = torch.randn(n, device="cuda")
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, k, device="cuda").to(dtype)
        s, b = scales.to(dtype), bias.to(dtype)
        for p in (None, perm):
            ref = wna16_linear_ref(x, qweight, s, zeros, 4, group, perm=p, bias=b).float()
            out = wna16_wgmma_linear(x, qweight, s, zeros, group, config, bias=b, perm=p).float()
            assert (out - ref).abs().max() <= 1e-2 * ref.abs().max(), (dtype, p is None)
