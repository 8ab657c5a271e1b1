"""The one-row int4 streaming GEMV (kernels/wna16_stream.py) against the fp32 reference: the magic-number
unpack of every nibble position, zero points, bias, act-order read through perm, split-K with the
ordered last-arrival reduce (one and several RED-row chunks), a ragged last N block, 16-bit x, and the
dispatch of wna16_linear."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_stream import RED, StreamConfig, stream_config, stream_supported, wna16_stream_linear
from pagedllm.kernels.wna16_tc import TCConfig


def _weights(k: int, n: int, group: int, device):
    q = torch.randint(0, 16, (k, n), device=device)
    scales = (torch.rand(k // group, n, device=device) * 0.02 + 0.001).half()
    zeros = torch.randint(0, 16, (k // group, n), device=device, dtype=torch.uint8)
    return pack_along_k(q, 4), scales, zeros


def test_every_nibble_position(device):
    """q = 15 (the word's sign bit for nibble 7) at input i alone, x = e_i: y = (15 - z) * s exactly."""
    k, n, group = 128, 16, 128
    for i in range(8):
        q = torch.zeros(k, n, dtype=torch.int64, device=device)
        q[i] = 15
        zeros = torch.full((1, n), 5, dtype=torch.uint8, device=device)
        scales = torch.full((1, n), 0.5, dtype=torch.float16, device=device)
        x = torch.zeros(1, k, device=device)
        x[0, i] = 1.0
        out = wna16_stream_linear(x, pack_along_k(q, 4), scales, zeros, group, config=StreamConfig(16, 1, 4))
        assert torch.equal(out, torch.full((1, n), 5.0, device=device)), (i, out)


# one program per N block (no split); 2 splits of 2 steps; 8 splits of 32-input steps (group 128 =
# 4 steps); 32 splits (two RED-row chunks of the reduce); whole-step x sums, split and not; the next
# step's loads first (split, and one program per N block with whole-step sums)
CASES = [(256, StreamConfig(32, 4, 4)), (512, StreamConfig(64, 2, 4)), (512, StreamConfig(32, 2, 4, BLOCK_KW=4)),
         (1024, StreamConfig(16, 1, 2, BLOCK_KW=4)), (512, StreamConfig(32, 2, 4, STEP_SUMS=True)),
         (256, StreamConfig(64, 2, 4, BLOCK_KW=8, STEP_SUMS=True)), (512, StreamConfig(32, 2, 4, PREFETCH=True)),
         (512, StreamConfig(32, 8, 4, BLOCK_KW=8, STEP_SUMS=True, PREFETCH=True))]


@pytest.mark.parametrize(("k", "config"), CASES)
def test_matches_reference(device, k, config):
    n, group = 80, 128  # n not a multiple of BLOCK_N: ragged last block
    qweight, scales, zeros = _weights(k, n, group, device)
    perm = torch.randperm(k, device=device).to(torch.int32)
    x = torch.randn(1, k, device=device)
    bias = torch.randn(n, device=device)
    for p in (None, perm):
        for b in (None, bias):
            ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group, perm=p, bias=b)
            out = wna16_stream_linear(x, qweight, scales, zeros, group, bias=b, perm=p, config=config)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert k // (config.BLOCK_KW * 8 * config.STEPS) <= 2 * RED


def test_16bit_and_dispatch(device):
    k, n, group = 256, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    dtypes = (torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float16,)
    for dtype in dtypes:
        x = torch.randn(1, k, device=device).to(dtype)
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group).float()
        out = wna16_stream_linear(x, qweight, scales, zeros, group, config=StreamConfig(32, 1, 4)).float()
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
        # wna16_linear sends one int4 g128 row here (the default config)
        out = wna16_linear(x, qweight, scales, zeros, 4, group).float()
        assert (out - ref).abs().max() <= 1e-2 * ref.abs().max()
    x = torch.randn(1, k, device=device)
    assert stream_supported(x, 4, 128, k) and not stream_supported(x, 4, 64, k) and not stream_supported(x, 8, 128, k)
    assert not stream_supported(torch.randn(2, k, device=device), 4, 128, k)
    with pytest.raises(ValueError, match="must divide the group size"):
        wna16_stream_linear(x, qweight, scales, zeros, 64)
    with pytest.raises(ValueError, match="one row"):
        wna16_stream_linear(torch.randn(2, k, device=device), qweight, scales, zeros, group)
    # the sweep's table: qkv / o / down here, gate_up on the tensor-core kernel (K split 4 ways)
    assert [stream_config(n, k) for n, k in ((6144, 4096), (4096, 4096), (4096, 14336))] == [
        StreamConfig(64, 8, 2), StreamConfig(128, 2, 4), StreamConfig(64, 8, 2)]
    assert isinstance(stream_config(28672, 4096), TCConfig) and stream_config(28672, 4096).SPLIT_K == 4
    assert stream_config(1024, 2048) == StreamConfig(128, 2, 4)
    # a TCConfig routes the row to the tensor-core kernel: same result
    ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group)
    torch.testing.assert_close(wna16_stream_linear(x, qweight, scales, zeros, group, config=TCConfig(32, 2, 4, 2)),
                               ref, atol=1e-3, rtol=1e-3)
