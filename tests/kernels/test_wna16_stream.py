"""The one-row int4 streaming GEMV (kernels/wna16_stream.py) against the fp32 reference: the magic-number
unpack of every nibble position, zero points, bias, act-order read through perm, split-K with the
ordered last-arrival reduce (one and several RED-row chunks), a ragged last N block, 16-bit x, and the
dispatch of wna16_linear."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_stream import RED, wna16_stream_linear, wna16_stream_linear_rms_norm
from pagedllm.kernels.wna16_stream_config import StreamConfig, program_steps, stream_config, stream_supported
from pagedllm.kernels.wna16_stream_packed import wna16_packed_emulation
from pagedllm.kernels.wna16_tc import TCConfig
from tests.kernels.test_wna16_tc import _weights  # the int4 g-group weights of every int4 kernel test


def one_nibble_case(i: int, x_value: float, device):
    """K = 128 inputs, N = 16, one group: q = 15 at input i alone, zero point 5, scale 0.5, x = x_value
    * e_i, so y = (15 - 5) * 0.5 * x_value exactly. -> (x (1, K), packed weights, scales, zeros)."""
    k, n = 128, 16
    q = torch.zeros(k, n, dtype=torch.int64, device=device)
    q[i] = 15
    zeros = torch.full((1, n), 5, dtype=torch.uint8, device=device)
    scales = torch.full((1, n), 0.5, dtype=torch.float16, device=device)
    x = torch.zeros(1, k, device=device)
    x[0, i] = x_value
    return x, pack_along_k(q, 4), scales, zeros


def test_every_nibble_position(device):
    """q = 15 (the word's sign bit for nibble 7) at input i alone, x = e_i: y = (15 - z) * s exactly."""
    for i in range(8):
        x, packed, scales, zeros = one_nibble_case(i, 1.0, device)
        out = wna16_stream_linear(x, packed, scales, zeros, 128, config=StreamConfig(16, 1, 4))
        assert torch.equal(out, torch.full((1, 16), 5.0, device=device)), (i, out)


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
    # the sweeps' table: packed fp16 math for qkv / gate_up / down, the fp32 path for o
    assert [stream_config(n, k).MATH for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))] == [
        "f16x2", "fp32", "f16x2", "f16x2"]
    assert stream_config(1024, 2048) == StreamConfig(128, 2, 4)
    # a TCConfig routes the row to the tensor-core kernel: same result
    ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group)
    torch.testing.assert_close(wna16_stream_linear(x, qweight, scales, zeros, group, config=TCConfig(32, 2, 4, 2)),
                               ref, atol=1e-3, rtol=1e-3)


# Packed fp16 math (MATH="f16x2"): the torch emulation of its arithmetic held to the fp32 reference
# (the stated bound), then the kernel held to the emulation: under TRITON_INTERPRET=1 the kernel runs
# its non-asm path (the same roundings in fp32 ops), on a GPU the PTX.
PACKED_BOUND = 2e-3  # max |emulation - fp32 ref| / max |ref|, fp32 output (measured 2.3e-4 .. 7.6e-4)


def _bf16_values(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_packed_emulation_within_bound(rows):
    """Random x and x with outliers (6e4 would overflow an fp16 pair sum unscaled: 15 x 6e4 > 65504),
    at the two K of Llama-3.1-8B's linears' programs (one program's span and several)."""
    k, n, group = 4096, 48, 128
    qweight, scales, zeros = _weights(k, n, group, torch.device("cpu"))
    x_out = torch.randn(1, k) * 0.05
    x_out[0, torch.randperm(k)[:6]] = torch.tensor([3e3, -8e3, 2e4, -6e4, 1e3, 5e2])
    for x in (_bf16_values(torch.randn(1, k)), _bf16_values(x_out)):
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group)
        for span in (1024, 4096):
            emu = wna16_packed_emulation(x, qweight, scales, zeros, group, span, rows)
            assert torch.isfinite(emu).all()
            assert (emu - ref).abs().max() <= PACKED_BOUND * ref.abs().max(), (rows, span)
    # exact where every product and sum is an fp16 integer: x = 1, q - z in [-15, 15]
    x = torch.ones(1, k)
    ref = wna16_linear_ref(x, qweight, torch.ones_like(scales), zeros, 4, group)
    assert torch.equal(wna16_packed_emulation(x, qweight, torch.ones_like(scales), zeros, group, 1024, rows), ref)


PACKED_CASES = [(256, StreamConfig(32, 4, 4, MATH="f16x2")), (512, StreamConfig(64, 2, 4, MATH="f16x2", ROWS=2)),
                (512, StreamConfig(32, 2, 2, MATH="f16x2", ROWS=4)),
                (512, StreamConfig(32, 1, 2, BLOCK_KW=4, MATH="f16x2", ROWS=2)),
                (512, StreamConfig(32, 2, 4, MATH="f16x2", ROWS=2, X_SCRATCH=True)),
                (512, StreamConfig(64, 2, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True)),
                (512, StreamConfig(32, 2, 4, MATH="f16x2", ROWS=2, EARLY=True)),
                (256, StreamConfig(32, 2, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True, EARLY=True))]


@pytest.mark.parametrize(("k", "config"), PACKED_CASES)
def test_packed_kernel_matches_emulation(device, k, config):
    """One program per N block and split-K (2 and 16 programs a block), 1 / 2 / 4 rows chained, x
    pairs per step or from the scratch, scales / zero points per step moved or loaded in the tile's
    layout, the first step's words loaded first; a ragged last N block; act-order with bias."""
    _packed_kernel_case(device, k, config, 80)


def test_packed_kernel_whole_n_blocks(device):
    """N a multiple of BLOCK_N: the loads go unmasked."""
    _packed_kernel_case(device, 512, StreamConfig(32, 2, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True), 64)


def _packed_kernel_case(device, k: int, config: StreamConfig, n: int) -> None:
    group = 128
    qweight, scales, zeros = _weights(k, n, group, device)
    perm = torch.randperm(k, device=device).to(torch.int32)
    x = _bf16_values(torch.randn(1, k, device=device) * 3)
    bias = torch.randn(n, device=device)
    span = program_steps(config, k) * config.BLOCK_KW * 8
    xk = x.bfloat16() if device.type == "cuda" else x
    for p, b in ((None, None), (perm, bias)):
        emu = wna16_packed_emulation(x, qweight, scales, zeros, group, span, config.ROWS, perm=p)
        ref = wna16_linear_ref(x, qweight, scales, zeros, 4, group, perm=p)
        out = wna16_stream_linear(xk, qweight, scales, zeros, group, bias=b, perm=p, config=config).float()
        b = b if b is not None else 0
        # fp32 sums in another order (and, on the GPU, bf16 output): far below the packed rounding
        tol = (1e-5 if device.type == "cpu" else 4e-3) * ref.abs().max()
        assert (out - (emu + b)).abs().max() <= tol
        assert (out - (ref + b)).abs().max() <= PACKED_BOUND * ref.abs().max() + tol


def test_packed_every_nibble_and_refusals(device):
    """q = 15 at input i alone (each nibble position, the word's sign bit for nibble 7), x = e_i:
    y = (15 - z) * s exactly; then the configurations not built."""
    for i in range(8):
        x, packed, scales, zeros = one_nibble_case(i, 3.0, device)
        x = x.bfloat16() if device.type == "cuda" else x
        out = wna16_stream_linear(x, packed, scales, zeros, 128, config=StreamConfig(16, 1, 4, MATH="f16x2", ROWS=2))
        assert torch.equal(out.float(), torch.full((1, 16), 15.0, device=device)), (i, out)
    k, n, group = 128, 16, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    x = torch.randn(1, k, device=device)
    for bad in (StreamConfig(16, 1, 4, MATH="bf16x2"), StreamConfig(16, 1, 4, MATH="f16x2", ROWS=3)):
        with pytest.raises(ValueError, match="not built"):
            wna16_stream_linear(x, qweight, scales, zeros, group, config=bad)
    k = 384  # 3 steps: one program of 3 (its x max spans a non-power-of-two range)
    qweight, scales, zeros = _weights(k, n, group, device)
    with pytest.raises(ValueError, match="power-of-two number of steps"):
        wna16_stream_linear(torch.randn(1, k, device=device), qweight, scales, zeros, group,
                            config=StreamConfig(16, 3, 4, MATH="f16x2"))


def test_silu_and_mul_in_the_prologue(device):
    """act="silu_and_mul": x = [gate | up]; the f16x2 path computes silu(gate) * up in its x prologue
    (per step and from the scratch; act-order too) and equals the unfused pair; the fp32 path and
    the dispatch run the activation first."""
    from pagedllm.kernels.activation import silu_and_mul_ref

    k, n, group = 512, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    gate_up = _bf16_values(torch.randn(1, 2 * k, device=device) * 2)
    gate_up = gate_up.bfloat16() if device.type == "cuda" else gate_up
    x = silu_and_mul_ref(gate_up)
    perm = torch.randperm(k, device=device).to(torch.int32)
    for config in (StreamConfig(32, 2, 4, MATH="f16x2", ROWS=2, EARLY=True),
                   StreamConfig(32, 2, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True), StreamConfig(32, 2, 4)):
        for p in (None, perm):
            fused = wna16_stream_linear(gate_up, qweight, scales, zeros, group, perm=p, config=config,
                                        act="silu_and_mul").float()
            plain = wna16_stream_linear(x, qweight, scales, zeros, group, perm=p, config=config).float()
            ref = wna16_linear_ref(x.float(), qweight, scales, zeros, 4, group, perm=p)
            assert (fused - plain).abs().max() <= 1e-6 * ref.abs().max(), (config, p is not None)
    out = wna16_linear(gate_up, qweight, scales, zeros, 4, group, act="silu_and_mul").float()
    assert (out - wna16_linear_ref(x, qweight, scales, zeros, 4, group).float()).abs().max() <= 1e-2 * ref.abs().max()
    with pytest.raises(ValueError, match="x 2: gate and up"):
        wna16_stream_linear(x, qweight, scales, zeros, group, act="silu_and_mul")


def test_rms_norm_in_the_prologue(device):
    """wna16_stream_linear_rms_norm: (rms_norm(x + residual) @ W, x + residual). The f16x2 path computes
    the norm in its x prologue (split-K: every program the row's rstd; act-order) and equals rms_norm +
    the GEMV; the new residual is exact; the fp32 path runs rms_norm first. Refuses mismatched shapes."""
    from pagedllm.kernels.rmsnorm import rms_norm_ref

    k, n, group = 512, 64, 128
    qweight, scales, zeros = _weights(k, n, group, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x, residual = torch.randn(1, k, device=device).to(dtype), torch.randn(1, k, device=device).to(dtype)
    norm_weight = (1.0 + 0.3 * torch.randn(k, device=device)).to(dtype)
    normed, new_residual = rms_norm_ref(x, norm_weight, 1e-5, residual)
    perm = torch.randperm(k, device=device).to(torch.int32)
    for config in (StreamConfig(32, 2, 4, MATH="f16x2", ROWS=2, EARLY=True),
                   StreamConfig(32, 2, 2, MATH="f16x2", ROWS=4, X_SCRATCH=True, SZ_TILE=True), StreamConfig(32, 2, 4)):
        for p in (None, perm):
            out, r_out = wna16_stream_linear_rms_norm(x, residual, norm_weight, 1e-5, qweight, scales, zeros, group,
                                                      perm=p, config=config)
            plain = wna16_stream_linear(normed, qweight, scales, zeros, group, perm=p, config=config)
            ref = wna16_linear_ref(normed.float(), qweight, scales, zeros, 4, group, perm=p)
            # the rstd's sum runs in another order than rms_norm's: an input may round the other way
            assert (out.float() - plain.float()).abs().max() <= 2e-3 * ref.abs().max(), (config, p is not None)
            assert torch.equal(r_out, new_residual)
    with pytest.raises(ValueError, match="must be"):
        wna16_stream_linear_rms_norm(x, residual[:, :256], norm_weight, 1e-5, qweight, scales, zeros, group)
