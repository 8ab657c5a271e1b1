"""Block-wise FP8 (kernels/fp8_block_gemm.py): the per-token-group quantizer and the block-scaled GEMM (Triton;
the interpreter on the CPU, whose fp8 `tl.dot` takes e4m3 operands) against their torch references, ragged
M / N / K and ragged last blocks, bias, bf16 / fp16 / fp32 activations; the group-wise reference against a
plain fp32 matmul of the dequantized operands."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.fp8_block_gemm import (
    FP8_DTYPE,
    Fp8BlockConfig,
    cublas_block_shape_ok,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    fp8_block_linear,
    fp8_block_linear_ref,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
)
from tests.kernels.test_kv_cache_fp8_kernels import assert_same_fp8


def _weight(n: int, k: int, block: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random e4m3 weight (N, K) and its (ceil(N / bn), ceil(K / bk)) block scales (all distinct, so
    a scale read from the wrong block shows)."""
    bn, bk = block
    q = (torch.randn(n, k, device=device) * 100).clamp(-448, 448).to(FP8_DTYPE)
    s = torch.rand(-(-n // bn), -(-k // bk), device=device) * 1e-2 + 1e-3
    return q, s


def _dequantized(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q * s[n // bn, k // bk] by an explicit index (not the module's repeat_interleave)."""
    n, k = q.shape
    rows = torch.arange(n, device=q.device) // block[0]
    cols = torch.arange(k, device=q.device) // block[1]
    return q.float() * s[rows[:, None], cols[None, :]]


def assert_same_codes(got: torch.Tensor, want: torch.Tensor, ratio: torch.Tensor) -> None:
    """e4m3 codes equal to the reference's, `ratio` (M, K) fp32 being the x / s they round. On a GPU bit-equal;
    in the interpreter also allowed: its known misroundings (assert_same_fp8) and exact ties (bf16 inputs
    hit some: 84 lies halfway between 80 and 88, and the interpreter does not round it to the even 80)."""
    if got.is_cuda:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    tie = (got.float() + want.float()) / 2 == ratio.clamp(-448, 448)
    assert_same_fp8(torch.where(tie, want.float(), got.float()).to(FP8_DTYPE), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "k", "group"), [(5, 300, 128), (3, 96, 48), (2, 64, 128)])
def test_group_quant_matches_reference(device, dtype, m, k, group):
    # 300 = 2 x 128 + 44 and 64 < 128: a ragged last group; 48: a group that is not a power of two
    x = (torch.randn(m, k, device=device) * 3).to(dtype)
    x[1, :group] = 0.0  # an all-zero group: the scale's floor keeps it finite, its codes 0
    x[0, 5] = 2000.0  # one large value: its group's scale, not the row's
    q, s = per_token_group_quant_fp8(x, group)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, group)
    groups = -(-k // group)
    assert q.shape == (m, k) and s.shape == (m, groups)
    torch.testing.assert_close(s, ref_s, atol=0, rtol=0)
    assert_same_codes(q, ref_q, x.float() / ref_s.repeat_interleave(group, dim=1)[:, :k])
    # the reference's own contract: an all-zero group's floor; the large value sets its group's scale only
    assert ref_s[1, 0] == 1e-12 and (ref_q[1, :group].float() == 0).all()
    assert ref_s[0, 0] == pytest.approx(2000.0 / 448) and (groups == 1 or ref_s[0, 1:].max() < 1.0)
    # and it round-trips: within half an e4m3 step (1/16 relative; subnormals 2^-10 of the scale)
    s_el = ref_s.repeat_interleave(group, dim=1)[:, :k]
    err = (ref_q.float() * s_el - x.float()).abs()
    assert (err <= x.float().abs() / 16 + s_el * 2.0**-10 + 1e-6).all()


def test_group_quant_column_major_padded_scales(device):
    # cuBLASLt's 1 x 128 grid: the same codes and scales, stored with strides (1, M') for M' = M rounded up to 4;
    # K 1300 = 11 groups: two programs of 8 groups, the second with 3 (the rest masked), the last group ragged
    x = torch.randn(6, 1300, device=device, dtype=torch.bfloat16) * 4
    q, s = per_token_group_quant_fp8(x, 128)
    ref_q, ref_s = per_token_group_quant_fp8_ref(x, 128)
    torch.testing.assert_close(s, ref_s, atol=0, rtol=0)
    assert_same_codes(q, ref_q, x.float() / ref_s.repeat_interleave(128, dim=1)[:, :1300])
    q_cm, s_cm = per_token_group_quant_fp8(x, 128, column_major_scales=True, row_multiple=4)
    assert q_cm.shape == (8, 1300) and s_cm.shape == (8, 11) and s_cm.stride() == (1, 8)
    torch.testing.assert_close(s_cm[:6], s, atol=0, rtol=0)
    assert torch.equal(q_cm[:6].view(torch.uint8), q.view(torch.uint8))


def test_cublas_block_shape_rule():
    # 128 x 128 blocks, N whole blocks, K a multiple of 4 blocks (the grid cuBLASLt reads is padded to 4)
    assert cublas_block_shape_ok(6144, 4096, (128, 128)) and cublas_block_shape_ok(4096, 14336, (128, 128))
    assert not cublas_block_shape_ok(6144, 4096, (64, 128))  # other blocks: the Triton kernel
    assert not cublas_block_shape_ok(200, 4096, (128, 128))  # a ragged block row
    assert not cublas_block_shape_ok(4096, 384, (128, 128))  # 3 K blocks: a grid to pad


def test_cublas_block_device_probe(monkeypatch, caplog):
    # the device rule without a GPU: sm_90 and CUDA >= 12.9, then one probe GEMM whose failure falls back (with a
    # warning) and is remembered; inside a graph capture nothing is probed or remembered
    from pagedllm.kernels import device_info
    from pagedllm.kernels import fp8_block_gemm as fbg

    calls = []

    def probe(*args, **kwargs):
        calls.append(args[0].shape)
        if fail:
            raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmulAlgoGetHeuristic")

    monkeypatch.setattr(fbg, "fp8_block_gemm_cublas", probe)
    monkeypatch.setattr(fbg, "_CUBLAS_BLOCK_DEVICES", {})
    monkeypatch.setattr(device_info, "_SM90", {})
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: torch.empty(a, dtype=k.get("dtype")))
    monkeypatch.setattr(torch, "ones", lambda *a, **k: torch.empty(a))
    fail = False
    assert not fbg._cublas_block_device(0) and calls == [] and fbg._CUBLAS_BLOCK_DEVICES == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fbg._cublas_block_device(0) and calls == [(4, 512)]
    assert fbg._cublas_block_device(0) and len(calls) == 1  # remembered
    fail = True
    assert not fbg._cublas_block_device(1) and "Triton" in caplog.text and "NOT_SUPPORTED" in caplog.text
    assert not fbg._cublas_block_device(1) and len(calls) == 2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))  # not sm_90: no probe
    assert not fbg._cublas_block_device(2) and len(calls) == 2
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert not fbg._cublas_block_device(3) and len(calls) == 2


@pytest.mark.parametrize(("m", "n", "k", "block", "cfg"), [
    (5, 100, 200, (64, 48), Fp8BlockConfig(16, 32, 2, 4, 2)),  # bk 48: BLOCK_K 64 masked; K 200 = 4 x 48 + 8
    (37, 96, 256, (128, 128), Fp8BlockConfig(16, 32, 2, 4, 2)),  # N inside one block row; M 3 row tiles
    (20, 80, 160, (32, 64), Fp8BlockConfig(16, 64, 1, 4, 2)),  # K 160 = 2 x 64 + 32: a ragged last group
    (17, 64, 128, (16, 32), None),  # whole blocks (EVEN_K), the default config's 64-row tile
])
def test_gemm_matches_reference(device, m, n, k, block, cfg):
    qa, a_s = per_token_group_quant_fp8_ref(torch.randn(m, k, device=device) * 2, block[1])
    q, s = _weight(n, k, block, device)
    bias = torch.randn(n, device=device)
    ref = fp8_block_gemm_ref(qa, a_s, q, s, block, torch.float32, bias)
    out = fp8_block_gemm(qa, a_s, q, s, block, torch.float32, bias, config=cfg)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    # without bias, in bf16: the epilogue's cast
    out16 = fp8_block_gemm(qa, a_s, q, s, block, torch.bfloat16, None, config=cfg)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16, fp8_block_gemm_ref(qa, a_s, q, s, block, torch.bfloat16), atol=2e-2,
                               rtol=1e-2)


@pytest.mark.parametrize("block", [(64, 48), (16, 128)])
def test_group_sums_equal_a_dequantized_matmul(block):
    # The group-wise formula (the GEMM's) against (qa * s) @ (q * sw)^T with the scales indexed explicitly.
    m, n, k = 7, 100, 200
    qa, a_s = per_token_group_quant_fp8_ref(torch.randn(m, k) * 2, block[1])
    q, s = _weight(n, k, block, "cpu")
    bias = torch.randn(n)
    cols = torch.arange(k) // block[1]
    plain = (qa.float() * a_s[:, cols]) @ _dequantized(q, s, block).t() + bias
    torch.testing.assert_close(fp8_block_gemm_ref(qa, a_s, q, s, block, torch.float32, bias), plain, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_reference_and_dispatch(device, dtype):
    # fp8_block_linear_ref = group quantization + the dequantized fp32 matmul; fp8_block_linear takes it on
    # the CPU and the Triton pair on CUDA; a (batch, tokens, K) input keeps its leading dims.
    block = (64, 48)
    x = (torch.randn(2, 3, 200, device=device) * 2).to(dtype)
    q, s = _weight(100, 200, block, device)
    bias = torch.randn(100, device=device).to(dtype)
    qa, a_s = per_token_group_quant_fp8_ref(x.reshape(6, 200), block[1])
    cols = torch.arange(200, device=device) // block[1]
    plain = (qa.float() * a_s[:, cols]) @ _dequantized(q, s, block).t() + bias.float()
    ref = fp8_block_linear_ref(x.reshape(6, 200), q, s, block, bias)
    assert ref.dtype == dtype
    torch.testing.assert_close(ref.float(), plain.to(dtype).float(), atol=1e-4, rtol=1e-4)
    out = fp8_block_linear(x, q, s, block, bias)
    assert out.shape == (2, 3, 100) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    # On CUDA `out` is the Triton pair's. The interpreter's pair is not compared here: its quantizer's lost
    # carries (assert_same_fp8: a few % of the codes a binade low) move whole outputs; each kernel is held to
    # its reference on the same operands above.
    torch.testing.assert_close(out.reshape(6, 100).float(), ref.float(), atol=tol, rtol=tol)


def test_operands_checked(device):
    qa, a_s = per_token_group_quant_fp8_ref(torch.randn(4, 96, device=device), 48)
    q, s = _weight(32, 96, (16, 48), device)
    with pytest.raises(ValueError, match=r"expected a_scales \(4, 2\) and scale_inv \(2, 2\), got \(4, 2\) and "
                                         r"\(1, 2\)"):
        fp8_block_gemm(qa, a_s, q, s[:1], (16, 48), torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn operands"):
        fp8_block_gemm(qa.float(), a_s, q, s, (16, 48), torch.float32)
    with pytest.raises(ValueError, match="row-major"):
        per_token_group_quant_fp8(torch.randn(96, 4, device=device).t(), 48)
