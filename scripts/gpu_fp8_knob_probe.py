"""Two FP8 W1 knobs timed alone on one GPU (issue 19), before their W1 A/B (scripts/gpu_fp8_w1_ab.py):

  gemm    Llama-3.1-8B's four fp8 linears at 256 .. 8192 rows (mixed steps, prefill chunks): the row-scaled
          `torch._scaled_mm` (scale_a (M, 1), scale_b (1, N): what the dispatch runs above DEFER_MAX_M) against
          the unit-scale per-tensor call a deferring linear makes (deferring above 256 rows), plus the
          deferred output's error once materialized; CUDA events over rotating weight copies, us a call.
  swiglu  SwiGLU's fused quantizer (kernels/quant_act.py) on gate_up's 2 x 14336 outputs with a deferring
          gate_up's scales, at 8 / 16 / 32 warps (kernels/quant_act.row_warps), and without scales at its
          default warps; CUDA graphs of 20 calls.

  warps   the three one-row-a-program quant kernels at Llama-3.1-8B widths (RMSNorm + residual + quant at 4096,
          with and without a deferring o / down's scales; SwiGLU + quant at 2 x 14336 without scales; the row
          quantizer at 4096, o_proj's input) at 8 / 16 / 32 warps.

    python3 scripts/gpu_fp8_knob_probe.py [--sections gemm,swiglu,warps]

Prints a table a section.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
from _gpu_common import rotating_graph_us

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _time(fn: Callable[[], object]) -> float:
    """Microseconds a call of fn (no weights to rotate): `rotating_graph_us` over one copy."""
    return rotating_graph_us(lambda _: fn(), 1)


def _gemm_cell(name: str, ws: list[torch.Tensor], wsc: torch.Tensor, m: int) -> str:
    """One row of the gemm table: `ws` the weight copies (N, K) fp8, `wsc` (1, N) their scales."""
    n, k = ws[0].shape
    xq = torch.randn(m, k, device="cuda").to(ws[0].dtype)
    xs = torch.rand(m, 1, device="cuda") * 1e-2 + 1e-3
    one = torch.ones((), device="cuda")

    def call(sa: torch.Tensor, sb: torch.Tensor, i: int) -> torch.Tensor:
        return torch._scaled_mm(xq, ws[i].t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    tr = rotating_graph_us(lambda i: call(xs, wsc, i), len(ws))
    tu = rotating_graph_us(lambda i: call(one, one, i), len(ws))
    ref = torch._scaled_mm(xq, ws[0].t(), scale_a=xs, scale_b=wsc, out_dtype=torch.bfloat16).float()
    acc = torch._scaled_mm(xq, ws[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    mat = (acc.float() * xs * wsc).to(torch.bfloat16).float()
    err = ((mat - ref).abs().max() / ref.abs().max()).item()
    fl = 2 * m * n * k
    return (f"| {name} {n}x{k} | {m} | {tr:.1f} | {tu:.1f} | {tr / tu:.3f} | {fl / tr / 1e6:.0f} / "
            f"{fl / tu / 1e6:.0f} | {err:.1e} |")


def gemm() -> None:
    from pagedllm.kernels.scaled_mm import FP8_DTYPE

    print("| linear | M | row-scaled us | unit per-tensor us | ratio | TFLOP/s row / unit | materialized err |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        copies = max(2, int(2e8 // (n * k)) + 1)
        ws = [(torch.randn(n, k, device="cuda") * 0.05).to(FP8_DTYPE) for _ in range(copies)]
        wsc = torch.rand(1, n, device="cuda") * 1e-3 + 1e-4
        for m in (256, 512, 1024, 2048, 4096, 8192):
            print(_gemm_cell(name, ws, wsc, m), flush=True)


def _swiglu_row(m: int, inter: int) -> str:
    from pagedllm.kernels import quant_act
    from pagedllm.kernels.scaled_mm import FP8_DTYPE

    block = triton.next_power_of_2(inter)
    x = (torch.randn(m, 2 * inter, device="cuda") * 300).to(torch.bfloat16)
    rs, cs = torch.rand(m, 1, device="cuda") * 1e-2, torch.rand(2 * inter, device="cuda") * 1e-2
    xq = torch.empty(m, inter, device="cuda", dtype=FP8_DTYPE)
    sc = torch.empty(m, 1, device="cuda")

    def launch(warps: int, scaled: bool) -> None:
        quant_act._silu_and_mul_quant_kernel[(m,)](
            x, xq, sc, rs if scaled else sc, cs if scaled else sc, inter, x.stride(0), xq.stride(0),
            QMAX=448.0, IS_INT=False, IN_SCALES=scaled, BLOCK=block, num_warps=warps)

    outs, cells = [], []
    for warps in (8, 16, 32):
        cells.append(_time(lambda w=warps: launch(w, True)))
        launch(warps, True)
        torch.cuda.synchronize()
        outs.append((xq.view(torch.uint8).clone(), sc.clone()))
    same = all(torch.equal(a[0], outs[0][0]) and torch.equal(a[1], outs[0][1]) for a in outs)
    plain = _time(lambda: launch(16, False))
    return f"| {m} | {plain:.1f} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.1f} | {same} |"


def swiglu() -> None:
    print("| M | no scales (default warps) us | scaled 8 warps | scaled 16 (default) | scaled 32 | same output |")
    print("|---|---|---|---|---|---|")
    for m in (32, 64, 128, 256, 1024, 8192):
        print(_swiglu_row(m, 14336), flush=True)


def _warps_row(m: int) -> str:
    from pagedllm.kernels import quant_act
    from pagedllm.kernels.scaled_mm import FP8_DTYPE

    h, inter = 4096, 14336
    x = (torch.randn(m, h, device="cuda") * 300).to(torch.bfloat16)
    res = torch.randn(m, h, device="cuda").to(torch.bfloat16)
    w = torch.rand(h, device="cuda").to(torch.bfloat16)
    rs, cs = torch.rand(m, 1, device="cuda") * 1e-2, torch.rand(h, device="cuda") * 1e-2
    xq = torch.empty(m, h, device="cuda", dtype=FP8_DTYPE)
    sc = torch.empty(m, 1, device="cuda")
    r_out = torch.empty_like(res)
    g = (torch.randn(m, 2 * inter, device="cuda") * 3).to(torch.bfloat16)
    gq = torch.empty(m, inter, device="cuda", dtype=FP8_DTYPE)
    b_h, b_i = triton.next_power_of_2(h), triton.next_power_of_2(inter)

    def norm(warps: int, scaled: bool) -> None:
        quant_act._rms_norm_quant_kernel[(m,)](
            x, res, w, xq, sc, r_out, rs if scaled else sc, cs if scaled else sc, h, 1e-5, x.stride(0),
            res.stride(0), xq.stride(0), r_out.stride(0), QMAX=448.0, IS_INT=False, HAS_RESIDUAL=True,
            IN_SCALES=scaled, BLOCK=b_h, num_warps=warps)

    def silu(warps: int) -> None:
        quant_act._silu_and_mul_quant_kernel[(m,)](
            g, gq, sc, sc, sc, inter, g.stride(0), gq.stride(0), QMAX=448.0, IS_INT=False, IN_SCALES=False,
            BLOCK=b_i, num_warps=warps)

    def quant(warps: int) -> None:
        quant_act._quant_row_kernel[(m,)](x, xq, sc, sc, h, x.stride(0), xq.stride(0), QMAX=448.0, IS_INT=False,
                                          STATIC=False, BLOCK=b_h, ONE_PASS=True, num_warps=warps)

    cells = []
    for fn in (lambda wp: norm(wp, False), lambda wp: norm(wp, True), silu, quant):
        ts = [_time(lambda wp=wp, fn=fn: fn(wp)) for wp in (8, 16, 32)]
        cells.append(" / ".join(f"{t:.1f}" for t in ts))
    return f"| {m} | " + " | ".join(cells) + " |"


def warps() -> None:
    print("| M | RMSNorm+res+quant 8 / 16 / 32 warps us | same, scaled | SwiGLU+quant (no scales) | row quant 4096 |")
    print("|---|---|---|---|---|")
    for m in (32, 64, 128, 256, 1024, 8192):
        print(_warps_row(m), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="gemm,swiglu,warps")
    args = ap.parse_args()
    torch.manual_seed(0)
    for s in args.sections.split(","):
        print(f"\n## {s}", flush=True)
        {"gemm": gemm, "swiglu": swiglu, "warps": warps}[s]()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
