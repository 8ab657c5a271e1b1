"""The int4 tensor-core kernel (kernels/wna16_tc.py) against the fp32 reference: zero points, bias,
act-order read through perm, split-K, several M blocks; fp32 and fp16 activations in the interpreter
(its USE_ASM=False path), the inline-PTX unpack on a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.wna16_gemm import pack_along_k, tc_max_m, wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_tc import TCConfig, tc_config, wna16_tc_linear


def _weights(k: int, n: int, group: int, device):
    q = torch.randint(0, 16, (k, n), device=device)
    scales = (torch.rand(k // group, n, device=device) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (k // group, n), device=device, dtype=torch.uint8)
    return pack_along_k(q, 4), scales, zeros


# (m, config): one program per N block; split-K over 2 steps (x as one tile split in registers);
# two M blocks of 16 rows with split-K, prescaled weights.
CASES = [(1, TCConfig(32, 1, 4, 2)), (3, TCConfig(32, 2, 4, 2, X_TILE=True)),
         (20, TCConfig(64, 2, 4, 2, 16, 16, PRESCALE=True))]


@pytest.mark.parametrize(("m", "config"), CASES)
def test_tc_kernel_matches_reference(device, m, config):
    k, n, group = 256, 80, 128  # n not a multiple of BLOCK_N: ragged last block
    qweight, scales, zeros = _weights(k, n, group, device)
    perm = torch.randperm(k, device=device).to(torch.int32)
    x = torch.randn(m, k, device=device)
    bias = torch.randn(n, device=device)
    for p in (None, perm):
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group, perm=p, bias=bias)
        # fp32 x: the shift + convert unpack (the PTX one is for 16-bit x), IEEE fp32 dots
        out = wna16_tc_linear(x, qweight, scales, zeros, group, bias=bias, perm=p, config=config, use_asm=False)
        torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


def test_tc_kernel_16bit(device):
    """16-bit x: OFF + q in x's dtype (fp16 in the interpreter; bf16 and the PTX unpack on a GPU)."""
    k, n, group = 256, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float16,)
    for dtype in dtypes:
        x = torch.randn(2, k, device=device).to(dtype)
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group).float()
        for prescale in (False, True):
            cfg = TCConfig(32, 2, 4, 2, PRESCALE=prescale)
            out = wna16_tc_linear(x, qweight, scales, zeros, group, config=cfg).float()
            assert (out - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_dispatch_and_config(device):
    k, n, group = 256, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    x = torch.randn(1, k, device=device)
    # wna16_linear routes int4 g128 decode rows here; a group of 64 stays on the FMA GEMV.
    torch.testing.assert_close(wna16_linear(x, qweight, scales, zeros, 4, group),
                               wna16_linear_ref(x, qweight, scales, zeros, 4, group), atol=1e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="must divide the group size"):
        wna16_tc_linear(x, qweight, scales, zeros, 64)
    # act-order above 16 rows: x gathered once, then the kernel without perm
    perm = torch.randperm(k, device=device).to(torch.int32)
    x20 = torch.randn(20, k, device=device)
    torch.testing.assert_close(wna16_linear(x20, qweight, scales, zeros, 4, group, perm=perm),
                               wna16_linear_ref(x20, qweight, scales, zeros, 4, group, perm=perm), atol=1e-3, rtol=1e-3)
    # The sweep's picks: down (14336 -> 4096) at M = 1 in 32 blocks x 16 splits on 4 warps; the
    # kernel up to 128 rows only for large weights (gate_up, down), 64 for qkv / o.
    assert tc_config(1, 4096, 14336)[:4] == (128, 16, 4, 3)
    assert tc_config(1, 28672, 4096).SPLIT_K == 2 and tc_config(16, 4096, 14336).SPLIT_K == 4
    assert tc_max_m(28672, 4096) == 128 and tc_max_m(6144, 4096) == 64
