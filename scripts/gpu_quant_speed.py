"""Quantized linears on the GPU (issue 19): correctness on the Llama-3.1-8B shapes, times, sweeps, and
the batch-1 decode step of the 8B model per method. One call, < 5 minutes on one H200:

    python3 scripts/gpu_quant_speed.py [--out DIR] [--sections tests,decode,kernels,sweep]

tests    the quant kernel tests on the GPU (subprocess)
decode   `pagedllm bench latency` batch 1 (dummy weights) for bf16, fp8 (online), awq, gptq (int4 g128),
         each in its own process, before this process touches the GPU
kernels  every linear (qkv, o, gate_up, down) at M = 1, 16, 64, 256, 2048: bf16 (the model's dense path),
         fp8 (Triton quant + torch._scaled_mm; also with use_fast_accum, and the GEMM alone), int8
         (quant + _int_mm + epilogue), W4A16 g128 (default dispatch; the tile kernel and the dequantized
         scratch + cuBLAS at M >= 64; act-order at M = 1 and 256); each checked against its torch
         reference (max |err| / max |ref| <= 2e-2)
sweep    W4A16 GEMV configs at M = 1 and 16, tile-kernel configs at M = 64 / 256 / 2048
Times: CUDA-graph replays of 20 calls (5 at M = 2048), rotating over enough weight copies (>= 150 MB)
that L2 (50 MB) cannot hold them; microseconds per call. Tables last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from _quant_report import bench_decode, int4_model_dirs, print_kernel_table, run_pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [1, 16, 64, 256, 2048]
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def run_tests() -> str:
    return run_pytest(["tests/kernels/test_wna16_gemm.py", "tests/kernels/test_scaled_mm.py",
                       "tests/kernels/test_quant_act.py", "tests/kernels/test_kv_cache_fp8_kernels.py"], timeout=150)


def run_decode(out_dir: str) -> list[tuple[str, str]]:
    runs = [("bf16", ["--model", "pagedllm/model_configs/llama3-8b"]),
            ("fp8", ["--model", "pagedllm/model_configs/llama3-8b", "--quantization", "fp8"])]
    runs += [(name, ["--model", d]) for name, d in int4_model_dirs(out_dir).items()]
    rows = []
    for tag, args in runs:
        rows.append((tag, bench_decode(args, os.path.join(out_dir, f"lat_{tag}.json"), timeout=75)))
        log(f"decode {tag}: {rows[-1][1]}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="qspeed_"))
    ap.add_argument("--sections", default="tests,decode,kernels,sweep")
    ap.add_argument("--budget", type=float, default=285.0, help="seconds after which the sweep stops")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    os.makedirs(a.out, exist_ok=True)
    tests = run_tests() if "tests" in sections else "not run"
    log(f"tests: {tests.splitlines()[-1] if tests else ''}")
    decode = run_decode(a.out) if "decode" in sections else []
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    from gpu_quant_speed_kernels import kernel_rows, sweep_rows  # the in-process half (CUDA)

    kern = kernel_rows(SHAPES, MS, log) if "kernels" in sections else []
    sweep = sweep_rows([SHAPES[3], SHAPES[2], SHAPES[0], SHAPES[1]], log, deadline=T0 + a.budget) if "sweep" in sections else []
    json.dump({"kernels": kern, "sweep": sweep, "decode": decode, "tests": tests},
              open(os.path.join(a.out, "results.json"), "w"), indent=1)

    print("\n## sweep (us; best first per shape / M)")
    print("| linear | M | config | us | weight GB/s |")
    print("|---|---|---|---|---|")
    for r in sweep:
        print(f"| {r['shape']} | {r['m']} | {r['config']} | {r['us']:.1f} | {r['gbs']:.0f} |")
    print("\n## kernels (us per call, CUDA graphs; err = max|out - ref| / max|ref|)")
    print_kernel_table(kern)
    print("\n## batch-1 decode step, Llama-3.1-8B shape (dummy weights)")
    for tag, res in decode:
        print(f"| {tag} | {res} |")
    print(f"\n## GPU kernel tests\n{tests}")
    print(f"\ntotal {time.time() - T0:.0f} s; results in {a.out}/results.json")


if __name__ == "__main__":
    main()
