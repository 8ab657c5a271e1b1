"""Issue 19, batch-1 int4 on the H200, the branch's final claim in one call of < 55 s: the 8B AWQ g128
dummy model's batch-1 decode step with the dispatch as committed (kernels/wna16_stream.py's table, the
residual add + RMSNorm and SwiGLU's activation in the one-row GEMVs' prologues), no sweep.

    python3 scripts/gpu_wna16_final.py [--only compile step step_gptq layer]

compile  worker processes compile the table's one-row launches at the four Llama-3.1-8B shapes (plain,
         with the norm in the prologue at qkv / gate_up, with the activation at down), in parallel,
         into the engine's Triton cache (the engine would otherwise compile them one by one at load)
step     128 in / 257 out, 3 iterations after one warm-up, as `bench latency` times decode steps
         (gpu_wna16_stream.batch1_steps, the loop all three int4 scripts share)
step_gptq  the same as GPTQ int4 g128 (desc_act false, sym): the same kernels after its load-time repack
layer    (if time is left) qkv / gate_up with the norm and down with the activation, each apart and
         fused, timed in the same run
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_wna16_stream as base  # noqa: E402 - sets the engine's Triton cache directory
from _gpu_common import record, run_sections  # noqa: E402

from pagedllm.kernels.activation import silu_and_mul  # noqa: E402
from pagedllm.kernels.rmsnorm import rms_norm  # noqa: E402
from pagedllm.kernels.wna16_gemm import wna16_linear  # noqa: E402
from pagedllm.kernels.wna16_stream import stream_config, wna16_stream_linear_rms_norm  # noqa: E402

G, SHAPES = base.G, base.SHAPES
JOBS = [("qkv", "plain"), ("qkv", "norm"), ("o", "plain"), ("gate_up", "plain"), ("gate_up", "norm"),
        ("down", "plain"), ("down", "act")]


def _warm(job: tuple[str, str]) -> str:
    shape, kind = job
    n, k = SHAPES[shape]
    t0 = time.monotonic()
    try:
        (w, s, z), = base.weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if kind == "plain":
            wna16_linear(x, w, s, z, 4, G)
        elif kind == "norm":
            wna16_stream_linear_rms_norm(x, x, x[0], 1e-5, w, s, z, G)
            rms_norm(x, x[0], 1e-5, x)
        else:
            gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
            wna16_linear(gu, w, s, z, 4, G, act="silu_and_mul")
            silu_and_mul(gu)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the engine then compiles it itself
        return f"{shape}/{kind} FAILED {type(e).__name__}: {str(e)[:300]}"
    return f"{shape}/{kind} {time.monotonic() - t0:.1f}s"


def precompile() -> None:
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(len(JOBS)) as pool:
        done = pool.map(_warm, JOBS, chunksize=1)
    print(f"precompiled {len(done)} in {time.monotonic() - t0:.1f} s: " + ", ".join(done), flush=True)
    print("table: " + "; ".join(f"{s} {stream_config(*SHAPES[s])}" for s in SHAPES), flush=True)


def step(method: str = "awq") -> None:
    # the graphs are captured at load: a short warm-up; the engine in its own process, as committed
    _, steps = base.batch1_steps(method, warm_tokens=33, in_process=False)
    record(f"batch-1 decode step, 8B {method.upper()} g128 (128 in / 257 out, 3 iters, the committed dispatch)",
           f"mean {statistics.fmean(steps) * 1e3:.3f} ms, p50 {statistics.median(steps) * 1e3:.3f} ms "
           f"(h40: 3.242; h44 final: AWQ 2.660; target 2.2)")


LAYER_BY_S = 47.0  # the fused / unfused timings only when the step is done by then (the round's 55 s)


def layer() -> None:
    """Same-run attribution: each one-row GEMV of a layer with the kernel before it as its own launch
    (rms_norm / silu_and_mul) and inside the GEMV's prologue, CUDA-graph replays over 2 weight copies."""
    from _gpu_common import rotating_graph_us

    from pagedllm.kernels.wna16_stream import wna16_stream_linear

    if time.monotonic() - base.T0 > LAYER_BY_S:
        record("layer timings", f"skipped: {time.monotonic() - base.T0:.0f} s gone")
        return
    for shape, kind in (("qkv", "norm"), ("gate_up", "norm"), ("down", "act")):
        n, k = SHAPES[shape]
        ws = base.weights(n, k, 2)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if kind == "norm":
            nw = torch.randn(k, device="cuda", dtype=torch.bfloat16)
            apart = rotating_graph_us(lambda i: wna16_stream_linear(rms_norm(x, nw, 1e-5, x)[0], *ws[i], G), 2)
            fused = rotating_graph_us(lambda i: wna16_stream_linear_rms_norm(x, x, nw, 1e-5, *ws[i], G)[0], 2)
        else:
            gu = torch.randn(1, 2 * k, device="cuda", dtype=torch.bfloat16)
            apart = rotating_graph_us(lambda i: wna16_linear(silu_and_mul(gu), *ws[i], 4, G), 2)
            fused = rotating_graph_us(lambda i: wna16_linear(gu, *ws[i], 4, G, act="silu_and_mul"), 2)
        record(f"{shape}: {kind} launch + GEMV / {kind} in the GEMV (2 weight copies: partly L2)",
               f"{apart:.1f} / {fused:.1f} us")


if __name__ == "__main__":
    run_sections({"compile": precompile, "step": step, "step_gptq": lambda: step("gptq"), "layer": layer})
