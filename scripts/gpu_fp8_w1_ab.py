"""W1 on the Llama-3.1-8B shape with quantization="fp8" (online), one `pagedllm bench throughput` process per
run, back to back, inside a wall budget: each run is TAG[:ENV=V,ENV=V][:extra flags], e.g.

    python3 scripts/gpu_fp8_w1_ab.py --budget 95 fp8 kvfp8::--kv-cache-dtype=fp8 \
        main-kvfp8:PAGEDLLM_FP8_KV_DOTS=0,PAGEDLLM_FUSED_ACT_QUANT=0:--kv-cache-dtype=fp8

(flags with '=' so they stay one token; a value may hold commas, fp8-qkv:PAGEDLLM_FP8_DEFER_SCALES=1,
PAGEDLLM_FP8_DEFER_LINEARS=qkv,gate_up: a comma starts the next switch only before NAME=; the switches name
the path a run takes: PAGEDLLM_FP8_KV_DOTS=0 and
PAGEDLLM_FUSED_ACT_QUANT=0 together are main's fp8 path before branch h43). A run starts only if the time
left covers a run (`--run-s`); the table last: tok/s, elapsed, engine start, the floor and the fraction.
`--warm` first compiles the Triton launches of kernels/w8a8_gemm.py's DECODE_TABLE (both row-count
specializations, M % 16 == 0 and != 0) in worker processes at once, into the engine's Triton cache, so that
the runs' engines do not compile them one after another at start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

BASE = ["-m", "pagedllm", "bench", "throughput", "--model", "llama3-8b", "--load-format", "dummy",
        "--skip-tokenizer-init", "--dataset", "w1", "--max-model-len", "4096", "--quantization", "fp8",
        "--hbm-bandwidth", "4.2e12", "--peak-flops", "1.6e15"]


def parse_run(spec: str) -> tuple[str, dict[str, str], list[str]]:
    tag, _, rest = spec.partition(":")
    env_part, _, flags = rest.partition(":")
    env = dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Z][A-Z0-9_]*=)", env_part) if kv)
    return tag, env, [f for f in flags.split(" ") if f]


def _warm_one(job: tuple[int, int, int, tuple]) -> str:
    """A worker: one DECODE_TABLE launch at (m, n, k) as the engine makes it (fp8 rows already quantized,
    bf16 out, no bias)."""
    import torch

    from pagedllm.kernels.w8a8_gemm import W8A8Config, ensure_workspace, w8a8_gemm

    m, n, k, fields = job
    t = time.monotonic()
    fp8 = torch.float8_e4m3fn
    try:
        ensure_workspace(torch.device("cuda"))
        w8a8_gemm(torch.zeros(m, k, device="cuda").to(fp8), torch.zeros(n, k, device="cuda").to(fp8),
                  torch.ones(m, 1, device="cuda"), torch.ones(n, device="cuda"), None, torch.bfloat16,
                  config=W8A8Config(*fields))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the engine then compiles (or fails) it itself
        return f"{m}x{n}x{k} FAILED {type(e).__name__}: {str(e)[:120]}"
    return f"{m}x{n}x{k} {time.monotonic() - t:.1f}s"


def warm_decode_table() -> None:
    import multiprocessing as mp

    from pagedllm.envs import use_triton_cache_dir
    from pagedllm.kernels.w8a8_gemm import DECODE_TABLE

    use_triton_cache_dir()  # the engine's cache; the workers inherit it
    jobs = []
    for (n, k), buckets in DECODE_TABLE.items():
        lo = 17
        for max_m, cfg in buckets:
            if cfg is not None:
                jobs += [(m, n, k, tuple(cfg)) for m in (max(lo, 24), 32 if lo <= 32 else lo + 15 - (lo + 15) % 16)]
            lo = max_m + 1
    t = time.monotonic()
    with mp.get_context("spawn").Pool(min(len(jobs), 14)) as pool:
        done = pool.map(_warm_one, jobs, chunksize=1)
    print(f"[warm] {len(done)} DECODE_TABLE launches in {time.monotonic() - t:.1f} s: " + "; ".join(done), flush=True)


def check_defer() -> str:
    """PAGEDLLM_FP8_DEFER_SCALES' two halves on the GPU at Llama-3.1-8B's down projection, 64 and 200 rows:
    the unit-scale cuBLASLt GEMM + materialize against the scaled GEMM, and the norm applying the scales
    against materialize + the norm (bit for bit)."""
    import torch

    from pagedllm.kernels.quant_act import rms_norm_quant
    from pagedllm.kernels.scaled_mm import FP8_DTYPE, ensure_unit_scale, materialize, w8a8_linear

    ensure_unit_scale(torch.device("cuda"))
    w = torch.randn(4096, 14336, device="cuda") * 0.05
    ws = w.abs().amax(1) / 448.0
    wq = (w / ws[:, None]).to(FP8_DTYPE)
    cells = []
    for m in (64, 200):
        x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
        y = w8a8_linear(x, wq, ws, None, None, defer_scales=True)
        ref = w8a8_linear(x, wq, ws, None, None)
        err = ((materialize(y).float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        r = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        nw = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        a = rms_norm_quant(y.acc, nw, 1e-5, FP8_DTYPE, r, in_scales=(y.row_scale, y.col_scale))
        b = rms_norm_quant(materialize(y), nw, 1e-5, FP8_DTYPE, r)
        same = all(torch.equal(u.view(torch.uint8) if u.dtype == FP8_DTYPE else u,
                               v.view(torch.uint8) if v.dtype == FP8_DTYPE else v) for u, v in zip(a, b))
        cells.append(f"M={m}: GEMM err {err:.1e} ({type(y).__name__}), norm {'bitwise equal' if same else 'DIFFERS'}")
    return "; ".join([*cells, check_defer_consumers()])


def check_defer_consumers(device: str = "cuda", m: int = 64, inter: int = 14336,
                          heads: tuple[int, int, int] = (32, 8, 128)) -> str:
    """The consumers of a deferring qkv_proj / gate_up_proj (Llama-3.1-8B's shapes, m rows): SwiGLU's fused
    quantizer, the fused prep and the fused decode step given a ScaledOutput's scales, against materialize + the
    same kernel without them (outputs and every cache byte, bit for bit)."""
    import torch

    from pagedllm.attention.metadata import build_metadata
    from pagedllm.kernels.decode_attention import decode_attention_fused
    from pagedllm.kernels.qkv_prep import fused_qkv_prep
    from pagedllm.kernels.quant_act import silu_and_mul_quant
    from pagedllm.kernels.quantized_activation import ScaledOutput
    from pagedllm.kernels.rotary import build_cos_sin_cache
    from pagedllm.kernels.scaled_mm import FP8_DTYPE, materialize

    def scaled(n: int) -> ScaledOutput:
        return ScaledOutput((torch.randn(m, n, device=device) * 300).to(torch.bfloat16),
                            torch.rand(m, 1, device=device) * 1e-2, torch.rand(n, device=device) * 1e-2)

    def same(a: tuple, b: tuple) -> str:
        bits = [t.view(torch.uint8) if t.dtype == FP8_DTYPE else t for t in (*a, *b)]
        return "bitwise equal" if all(torch.equal(u, v) for u, v in zip(bits[:len(a)], bits[len(a):])) else "DIFFERS"

    y = scaled(2 * inter)
    got = silu_and_mul_quant(y.acc, FP8_DTYPE, in_scales=(y.row_scale, y.col_scale))
    cells = [f"silu {same(got, silu_and_mul_quant(materialize(y), FP8_DTYPE))}"]
    h, kvh, d = heads
    y = scaled((h + 2 * kvh) * d)
    seq_lens = [int(s) for s in torch.randint(1, 128, (m,))]
    md = build_metadata([1] * m, seq_lens, [list(range(8 * i, 8 * i + 8)) for i in range(m)], 16, device=device)
    positions, cos_sin = md.seq_lens.long() - 1, build_cos_sin_cache(d, 128, device=device)
    cache = torch.randn(2, 8 * m, 16, kvh, d, device=device).to(torch.bfloat16)
    def prep(qkv: torch.Tensor, c: torch.Tensor, **k) -> torch.Tensor:
        return fused_qkv_prep(qkv, positions, cos_sin, c, md.slot_mapping, h, kvh, d, **k)

    def decode(qkv: torch.Tensor, c: torch.Tensor, **k) -> torch.Tensor:
        return decode_attention_fused(qkv, positions, cos_sin, c, md, d**-0.5, h, kvh, d, **k)

    for name, run in (("prep", prep), ("decode", decode)):
        got_cache, want_cache = cache.clone(), cache.clone()
        got = run(y.acc, got_cache, in_scales=(y.row_scale, y.col_scale))
        want = run(materialize(y), want_cache)
        cells.append(f"{name} {same((got, got_cache), (want, want_cache))}")
    return f"qkv / gate_up consumers at M={m}: " + ", ".join(cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--budget", type=float, default=95.0)
    ap.add_argument("--run-s", type=float, default=30.0, help="seconds a run needs (start + W1)")
    ap.add_argument("--warm", action="store_true", help="compile the DECODE_TABLE launches first (see above)")
    ap.add_argument("--check-defer", action="store_true", help="check PAGEDLLM_FP8_DEFER_SCALES' kernels first")
    args = ap.parse_args()
    t0 = time.monotonic()
    if args.warm:
        warm_decode_table()
    if args.check_defer:  # in a child process: this one holds no GPU memory while the runs' engines start
        import multiprocessing as mp

        try:
            with mp.get_context("spawn").Pool(1) as pool:
                print(f"[defer check] {pool.apply(check_defer)}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the runs still go
            print(f"[defer check] FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    rows = []
    for spec in args.runs:
        tag, env, flags = parse_run(spec)
        left = args.budget - (time.monotonic() - t0)
        if left < args.run_s:
            rows.append(f"| {tag} | not run: {left:.0f} s left of the budget | | | |")
            continue
        out = os.path.join(tempfile.gettempdir(), f"w1_{tag}.json")
        cmd = [sys.executable, *BASE, *flags, "--output-json", out]
        t = time.monotonic()
        proc = None
        try:
            proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                                  timeout=max(5.0, left - 2))
            wall = time.monotonic() - t
            d = json.load(open(out))
            rows.append(f"| {tag} | {d['output_tokens_per_second']:.0f} | {d['elapsed_time']:.2f} s | "
                        f"ready {d['startup_seconds']:.1f} s, process {wall:.0f} s | "
                        f"{d['floor_output_tokens_per_second']:.0f} ({100 * d['fraction_of_floor']:.1f}%) |")
        except Exception as e:  # noqa: BLE001 - a failed or cut run is a row, the next one still runs
            tail = (proc.stdout + proc.stderr)[-600:] if proc is not None else ""
            rows.append(f"| {tag} | failed: {type(e).__name__} {str(e)[:80]} | | | |")
            print(tail, flush=True)
        print(f"[{time.monotonic() - t0:.0f} s] {rows[-1]}  env={env} flags={flags}", flush=True)
    print("\n| run (W1, Llama-3.1-8B shape, fp8 online) | output tok/s | elapsed | start | floor (fraction) |\n"
          "|---|---|---|---|---|")
    for r in rows:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
