"""The in-process (CUDA) half of scripts/gpu_quant_speed.py: kernel correctness, times and sweeps.

Every time is a CUDA-graph replay of `reps` calls rotating over weight copies (>= 150 MB in all, so the
50 MB L2 cannot serve repeats); a call that cannot be captured is timed eagerly and marked so (a
quantized linear must capture: the model's decode steps run in CUDA graphs).
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable

import torch
from _gpu_common import rel_err, rotating_graph_us

from pagedllm.kernels import scaled_mm
from pagedllm.kernels.quant_act import quantize_activation_triton
from pagedllm.kernels.scaled_mm import FP8_DTYPE, choose_path, quantize_activation, scaled_mm_ref, w8a8_linear
from pagedllm.kernels.w8a16_gemv import w8a16_linear_ref
from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_config, wna16_linear, wna16_linear_ref
from pagedllm.kernels.wna16_gemv import WNA16GemvConfig, wna16_gemv, wna16_gemv_config
from pagedllm.quantization.base import _dense_linear

ROTATE_BYTES = 150e6
G = 128  # group size of the int4 weights (AWQ / GPTQ g128)


def copies_for(nbytes: float) -> int:
    return max(1, min(8, math.ceil(ROTATE_BYTES / nbytes)))


def graph_us(call: Callable[[int], object], copies: int, reps: int) -> tuple[float, str]:
    """Median microseconds per call of call(i), i rotating over the weight copies; a call that
    cannot be captured is timed eagerly, with a note saying so."""
    try:
        return rotating_graph_us(call, copies, reps), ""
    except Exception as e:  # noqa: BLE001 - report, then time eagerly
        torch.cuda.synchronize()
        note = f" [not capturable: {type(e).__name__}: {str(e)[:60]}]"
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for r in range(reps):
            call(r % copies)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times), note


def time_cases(rows: list[dict], name: str, m: int, cases: list[tuple], reps: int) -> None:
    """Appends a row per case (kernel name, call(i), weight copies, reference or None, weight bytes):
    its error against the reference, its graph-replay time and weight GB/s, or the error it raised."""
    for kname, call, copies, ref, nbytes in cases:
        row = {"shape": name, "m": m, "kernel": kname}
        try:
            out = call(0)
            if ref is not None:
                row["err"] = rel_err(out, ref)
            us, note = graph_us(call, copies, reps)
            row.update(us=us, note=note, gbs=nbytes / us / 1e3)
        except Exception as e:  # noqa: BLE001 - one failing kernel must not hide the others
            row["error"] = f"ERR {type(e).__name__}: {str(e)[:100]}"
        rows.append(row)


class Weights:
    """One linear's weights in every format, `copies` each (clones: distinct memory, same values)."""

    def __init__(self, n: int, k: int) -> None:
        dev = torch.device("cuda")
        w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
        self.bf16 = [w] + [w.clone() for _ in range(copies_for(n * k * 2) - 1)]
        w8, s8 = quantize_activation(w, FP8_DTYPE)
        wi, si = quantize_activation(w, torch.int8)
        self.fp8 = [(w8.clone(), s8.flatten().clone()) for _ in range(copies_for(n * k))]
        self.int8 = [(wi.clone(), si.flatten().clone()) for _ in range(copies_for(n * k))]
        q = torch.randint(0, 16, (k, n), device=dev)
        qw = pack_along_k(q, 4)
        sc = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (k // G, n), device=dev, dtype=torch.uint8)
        self.int4 = [(qw.clone(), sc.clone(), z.clone()) for _ in range(copies_for(n * k / 2))]
        self.perm = torch.randperm(k, device=dev).to(torch.int32)


def kernel_rows(shapes, ms, log) -> list[dict]:
    rows: list[dict] = []
    for name, n, k in shapes:
        wts = Weights(n, k)
        for m in ms:
            reps = 20 if m <= 256 else 5
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq8, xs8 = quantize_activation(x, FP8_DTYPE)
            xqi, xsi = quantize_activation(x, torch.int8)
            ref8 = scaled_mm_ref(xq8, wts.fp8[0][0], xs8, wts.fp8[0][1], None, torch.float32)
            refi = scaled_mm_ref(xqi, wts.int8[0][0], xsi, wts.int8[0][1], None, torch.float32)
            # The default dispatch's reference: weight-only where it takes "w8a16" (no activation quant).
            auto8, autoi = ref8, refi
            if choose_path(m, n, k, FP8_DTYPE) == "w8a16":
                auto8 = w8a16_linear_ref(x, *wts.fp8[0])
            if choose_path(m, n, k, torch.int8) == "w8a16":
                autoi = w8a16_linear_ref(x, *wts.int8[0])
            ref4 = wna16_linear_ref(x.float(), *wts.int4[0], 4, G)

            def fp8_accum(fast: bool):
                def call(i, x=x):
                    before, scaled_mm.FAST_ACCUM = scaled_mm.FAST_ACCUM, fast
                    try:
                        return w8a8_linear(x, *wts.fp8[i], None, None, path="cublas")
                    finally:
                        scaled_mm.FAST_ACCUM = before
                return call

            cases = [
                ("bf16", lambda i, x=x: _dense_linear(x, wts.bf16[i], None), len(wts.bf16), None, n * k * 2),
                ("fp8", lambda i, x=x: w8a8_linear(x, *wts.fp8[i], None, None), len(wts.fp8), auto8, n * k),
                ("fp8 exact-accum", fp8_accum(False), len(wts.fp8), ref8, n * k),
                ("fp8 GEMM only", lambda i, xq8=xq8, xs8=xs8: torch._scaled_mm(
                    xq8, wts.fp8[i][0].t(), scale_a=xs8, scale_b=wts.fp8[i][1].view(1, -1), out_dtype=torch.bfloat16),
                 len(wts.fp8), ref8, n * k),
                ("fp8 quant only", lambda i, x=x: quantize_activation_triton(x, FP8_DTYPE), 1, None, 0),
                ("int8", lambda i, x=x: w8a8_linear(x, *wts.int8[i], None, None), len(wts.int8), autoi, n * k),
                ("w4a16", lambda i, x=x: wna16_linear(x, *wts.int4[i], 4, G), len(wts.int4), ref4, n * k / 2),
            ]
            if m >= 64:
                cases += [("w4a16 tile", lambda i, x=x: wna16_linear(x, *wts.int4[i], 4, G, dequant_min_m=1 << 30),
                           len(wts.int4), ref4, n * k / 2),
                          ("w4a16 dequant+cuBLAS", lambda i, x=x: wna16_linear(x, *wts.int4[i], 4, G, dequant_min_m=1),
                           len(wts.int4), ref4, n * k / 2)]
            if m in (1, 256):
                ref4p = wna16_linear_ref(x.float(), *wts.int4[0], 4, G, perm=wts.perm)
                cases.append(("w4a16 act-order", lambda i, x=x: wna16_linear(x, *wts.int4[i], 4, G, perm=wts.perm),
                              len(wts.int4), ref4p, n * k / 2))
            time_cases(rows, name, m, cases, reps)
            log(f"kernels {name} M={m}: " + ", ".join(
                f"{r['kernel']} {r['us']:.1f}" if "us" in r else f"{r['kernel']} {r.get('error')}"
                for r in rows if r["shape"] == name and r["m"] == m))
        wts = None  # noqa: F841 - free this shape's weights before the next
        torch.cuda.empty_cache()
    return rows


GEMV_SPACE = [(bn, nw, ns) for bn in (64, 128, 256) for nw, ns in ((4, 2), (8, 3))]
SPLITS = (1, 2, 4, 8, 16, 32)
TILE_SPACE = [(64, 128, 128, 1, 4, 3), (64, 128, 128, 2, 4, 3), (64, 128, 128, 4, 4, 3), (64, 256, 128, 1, 8, 3),
              (128, 128, 128, 1, 8, 3), (128, 256, 128, 1, 8, 3), (64, 128, 64, 1, 4, 4), (128, 128, 64, 1, 4, 4),
              (32, 128, 128, 4, 4, 3), (64, 64, 128, 2, 4, 3)]


def _best(rows: list[dict], shape: str, m: int, found: list[dict], default_cfg: str, keep: int = 4) -> None:
    ok = sorted((r for r in found if r.get("err", 1) <= 2e-2), key=lambda r: r["us"])
    bad = [r for r in found if not r.get("err", 1) <= 2e-2]
    default = [r for r in found if r["config"] == default_cfg]
    for r in ok[:keep] + [dict(d, config="default " + d["config"]) for d in default]:
        rows.append(dict(r, shape=shape, m=m))
    for r in bad[:2]:
        rows.append(dict(r, shape=shape, m=m, config=f"OFF err {r.get('err')} {r['config']}", us=0.0, gbs=0.0))


def sweep_rows(shapes, log, deadline: float = float("inf")) -> list[dict]:
    """Stops (and says so) once time.time() passes `deadline`, keeping the run inside its slot."""
    rows: list[dict] = []
    for name, n, k in shapes:
        if time.time() > deadline:
            log(f"sweep: {name} and later shapes skipped (time budget)")
            break
        wts = Weights(n, k)
        steps = k // G
        for m in (1, 16, 64):  # 64: the GEMV's tensor-core path against the tile kernel below
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wna16_linear_ref(x.float(), *wts.int4[0], 4, G)
            found = []
            for (bn, nw, ns), split in itertools.product(GEMV_SPACE, SPLITS):
                if split > steps:
                    continue
                cfg = WNA16GemvConfig(bn, 16, split, nw, ns)
                try:
                    err = rel_err(wna16_gemv(x, *wts.int4[0], 4, G, config=cfg), ref)
                    us, _ = graph_us(lambda i, x=x, cfg=cfg: wna16_gemv(x, *wts.int4[i], 4, G, config=cfg),
                                     len(wts.int4), 20)
                    found.append({"config": f"gemv BN{bn} split{split} w{nw} s{ns}", "us": us, "err": err,
                                  "gbs": n * k / 2 / us / 1e3})
                except Exception as e:  # noqa: BLE001
                    log(f"gemv {cfg}: {type(e).__name__}: {str(e)[:80]}")
            d = wna16_gemv_config(m, n, k, G, 4)
            _best(rows, name, m, found, f"gemv BN{d.BLOCK_N} split{d.SPLIT_K} w{d.num_warps} s{d.num_stages}")
            best = min(found, key=lambda r: r["us"]) if found else None
            log(f"sweep gemv {name} M={m}: best {best}")
        for m in (64, 256, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = wna16_linear_ref(x.float(), *wts.int4[0], 4, G)
            reps = 20 if m <= 256 else 5
            found = []
            default = wna16_config(m, n, k, G, 4)
            for cfg in [*TILE_SPACE, default]:
                try:
                    err = rel_err(wna16_linear(x, *wts.int4[0], 4, G, config=cfg), ref)
                    us, _ = graph_us(lambda i, x=x, cfg=cfg: wna16_linear(x, *wts.int4[i], 4, G, config=cfg),
                                     len(wts.int4), reps)
                    found.append({"config": f"tile {cfg}", "us": us, "err": err, "gbs": n * k / 2 / us / 1e3})
                except Exception as e:  # noqa: BLE001
                    log(f"tile {cfg}: {type(e).__name__}: {str(e)[:80]}")
            _best(rows, name, m, found, f"tile {default}", keep=3)
            log(f"sweep tile {name} M={m} done")
        wts = None  # noqa: F841 - free this shape's weights before the next
        torch.cuda.empty_cache()
    return rows

