"""FP8 experts in the fused MoE kernels (the W_SCALED variant; interpreter on CPU) equal the torch
reference on the dequantized weights. Triton's interpreter loads float8_e4m3fn and converts it
(checked here against the reference); its bf16 tl.dot is wrong (test_fused_moe_kernel.py), so the
interpreter runs fp32 and fp16 activations, the GPU bf16 as well."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kernels.fused_moe import fused_experts
from pagedllm.layers.fused_moe.router import select_experts
from pagedllm.layers.fused_moe.torch_ref import fused_experts_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _fp8_experts(e: int, hidden: int, inter: int, g: torch.Generator):
    """Random experts quantized per expert (scales differ by expert, so a wrong expert's scale shows)."""
    w13 = torch.randn(e, 2 * inter, hidden, generator=g) * torch.linspace(0.1, 0.4, e)[:, None, None]
    w2 = torch.randn(e, hidden, inter, generator=g) * torch.linspace(0.4, 0.1, e)[:, None, None]
    out = []
    for w in (w13, w2):
        s = w.abs().amax((1, 2)) / 448.0
        out += [(w / s[:, None, None]).to(FP8).to(DEVICE), s.float().to(DEVICE)]
    return out  # q13, s13, q2, s2


CONFIGS = {
    "default": None,  # fused_experts' own pick (the row lists at these sizes; fp32 / fp16 tiles)
    "align-separate-silu": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2, FUSE_SILU=False),
    "row-lists": dict(SCAN=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2,
                      DOWN=dict(BLOCK_N=16)),
    "align-fused-silu": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", list(CONFIGS))
@pytest.mark.parametrize("t, e, top_k, hidden, inter", [(5, 4, 2, 64, 32), (37, 8, 3, 32, 48)])
def test_fp8_experts_match_the_dequantized_reference(t, e, top_k, hidden, inter, path, dtype):
    g = torch.Generator().manual_seed(t + e)
    q13, s13, q2, s2 = _fp8_experts(e, hidden, inter, g)
    x = torch.randn(t, hidden, generator=g).to(dtype).to(DEVICE)
    weights, ids = select_experts(torch.randn(t, e, generator=g).to(DEVICE), top_k, renormalize=True)
    got = fused_experts(x, q13, q2, weights, ids, config=CONFIGS[path], w13_scale=s13, w2_scale=s2)
    ref = fused_experts_ref(x.float(), q13, q2, weights, ids, s13, s2)
    # the reference is the dequantized weights' plain product: fused_experts_ref on fp32 copies
    plain = fused_experts_ref(x.float(), q13.float() * s13[:, None, None], q2.float() * s2[:, None, None], weights, ids)
    torch.testing.assert_close(ref, plain, atol=0, rtol=0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_fp8_experts_are_refused_without_their_scales():
    g = torch.Generator().manual_seed(0)
    q13, s13, q2, s2 = _fp8_experts(4, 32, 16, g)
    x = torch.randn(3, 32).to(DEVICE)
    w, ids = select_experts(torch.randn(3, 4).to(DEVICE), 2, True)
    with pytest.raises(ValueError, match="need w13_scale and w2_scale"):
        fused_experts(x, q13, q2, w, ids)
    with pytest.raises(ValueError, match="both w13_scale and w2_scale"):
        fused_experts(x, q13, q2, w, ids, w13_scale=s13)
    with pytest.raises(ValueError, match=r"w2_scale must be \(4,\) float32"):
        fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2[:, None])
    with pytest.raises(ValueError, match="come with float8_e4m3fn experts"):
        fused_experts(x, q13.float(), q2.float(), w, ids, w13_scale=s13, w2_scale=s2)


def test_fp8_prefill_tiles_leave_out_tma(monkeypatch):
    # The largest steps pick the TMA tiles for 16-bit weights; FP8 experts take the same tiles by the
    # pointer kernel (recorded here instead of run: a 128 x 128 tile step is slow in the interpreter).
    from pagedllm.kernels import fused_moe, moe_grouped_gemm

    calls = []
    monkeypatch.setattr(fused_moe, "_config", lambda n, dtype: dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4,
                                                                    FUSE_SILU=True, TMA=True))
    monkeypatch.setattr(fused_moe, "_scan_config", lambda *a: None)
    real = moe_grouped_gemm._grouped_gemm

    def record(*args, **kwargs):
        calls.append(args[9])
        real(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "_grouped_gemm", record)
    g = torch.Generator().manual_seed(1)
    q13, s13, q2, s2 = _fp8_experts(4, 32, 32, g)
    x = torch.randn(6, 32, generator=g).to(DEVICE)
    w, ids = select_experts(torch.randn(6, 4, generator=g).to(DEVICE), 2, True)
    got = fused_experts(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2)
    assert calls and not any(c.get("TMA") for c in calls)
    torch.testing.assert_close(got, fused_experts_ref(x, q13, q2, w, ids, s13, s2), atol=1e-4, rtol=1e-4)
