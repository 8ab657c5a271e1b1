"""W4A16 / W8A16 dequant-GEMM (Triton) against its fp32 reference, and the reference against a dense
matmul of independently dequantized weights, for ragged shapes, split-K and act-order."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.wna16_gemm import (
    dequantize_wna16,
    dequantize_wna16_triton,
    pack_along_k,
    unpack_along_k,
    wna16_config,
    wna16_linear,
    wna16_linear_ref,
)
from pagedllm.kernels.wna16_gemv import wna16_gemv_config


def _weights(k: int, n: int, bits: int, group: int, device):
    q = torch.randint(0, 1 << bits, (k, n), device=device)
    scales = (torch.rand(k // group, n, device=device) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 1 << bits, (k // group, n), device=device, dtype=torch.uint8)
    return q, pack_along_k(q, bits), scales, zeros


def test_pack_layout_worked_example():
    word = pack_along_k(torch.tensor([[1], [2], [10], [3], [0], [0], [0], [0]]), 4)
    assert word.item() == 0x00003A21
    w = dequantize_wna16(word, torch.tensor([[0.5], [0.25]]), torch.tensor([[8], [8]], dtype=torch.uint8), 4, 4)
    assert w.flatten().tolist() == [-3.5, -3, 1, -2.5, -2, -2, -2, -2]
    high = pack_along_k(torch.full((8, 1), 15), 4)  # the sign bit set: still every nibble back
    assert high.item() == -1 and unpack_along_k(high, 4).flatten().tolist() == [15] * 8


# (m, config, dequant_min_m): GEMV with FMA (m 1) and tensor cores (m 3), each split over K by the
# default config; the tile kernel (a config given) with and without split-K; the tile kernel by
# default (m 40); the dequantized-scratch path (dequant_min_m 1).
PATHS = [(1, None, None), (3, None, None), (3, (16, 32, 32, 4), None), (21, (32, 64, 64, 1), None),
         (40, None, None), (20, None, 1)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "config", "dequant_min_m"), PATHS)
def test_kernel_matches_reference(device, bits, m, config, dequant_min_m):
    k, n, group = 256, 48, 64  # n not a multiple of BLOCK_N: ragged last column block
    q, qweight, scales, zeros = _weights(k, n, bits, group, device)
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device)
    ref = wna16_linear_ref(x, qweight, scales, zeros, bits, group, bias=bias)
    dense = x @ ((q.float() - zeros.float().repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0))
    torch.testing.assert_close(ref, dense + bias, atol=1e-4, rtol=1e-4)
    # fp32 x: the kernels' dots run in IEEE fp32 (not TF32), so they match the fp32 reference closely.
    out = wna16_linear(x, qweight, scales, zeros, bits, group, bias=bias, config=config,
                       dequant_min_m=dequant_min_m)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_dequantize_kernel_and_bf16(device):
    k, n, group = 128, 40, 32
    _, qweight, scales, zeros = _weights(k, n, 4, group, device)
    ref = dequantize_wna16(qweight, scales, zeros, 4, group)
    assert torch.equal(dequantize_wna16_triton(qweight, scales, zeros, 4, group, torch.float32), ref)
    # The GEMV's tensor-core path in 16-bit: bf16 on a GPU; fp16 in Triton 3.6's interpreter, whose
    # bf16 tl.dot multiplies the raw bits (off by ~1e10 on any input).
    x = torch.randn(2, k, device=device).to(torch.bfloat16 if device.type == "cuda" else torch.float16)
    out = wna16_linear(x, qweight, scales, zeros, 4, group)
    torch.testing.assert_close(out.float(), wna16_linear_ref(x, qweight, scales, zeros, 4, group).float(),
                               atol=2e-2, rtol=2e-2)


def test_act_order_permutation(device):
    k, n, group, bits = 128, 32, 32, 4
    q, qweight, scales, zeros = _weights(k, n, bits, group, device)
    perm = torch.randperm(k, device=device).to(torch.int32)  # as WNA16LinearMethod stores it
    for m in (5, 17):  # the GEMV gathers x by perm; the tile kernel folds perm into its (step, j, kp) order
        x = torch.randn(m, k, device=device)
        ref = wna16_linear_ref(x, qweight, scales, zeros, bits, group, perm=perm)
        torch.testing.assert_close(ref, x[:, perm] @ dequantize_wna16(qweight, scales, zeros, bits, group))
        torch.testing.assert_close(wna16_linear(x, qweight, scales, zeros, bits, group, perm=perm), ref,
                                   atol=1e-3, rtol=1e-3)


def test_config_splits_k_for_skinny_batches():
    bm, bn, bk, split, *_ = wna16_config(20, 4096, 4096, 128)
    assert (bm, bk) == (32, 128) and split > 1 and (4096 // bn) * split >= 132
    assert wna16_config(4096, 4096, 4096, 128)[3] == 1
    # The GEMV's measured picks: down (14336 -> 4096) at M = 1 splits K 16 ways, gate_up 4 ways.
    assert wna16_gemv_config(1, 4096, 14336, 128, 4) == (128, 16, 16, 8, 3)
    assert wna16_gemv_config(1, 28672, 4096, 128, 4).SPLIT_K == 4
    with pytest.raises(ValueError, match="multiple of 16"):
        wna16_config(1, 64, 64, 8)
