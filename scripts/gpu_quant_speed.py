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
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [1, 16, 64, 256, 2048]
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def run_tests() -> str:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_wna16_gemm.py",
           "tests/kernels/test_scaled_mm.py", "tests/kernels/test_quant_act.py", "tests/kernels/test_kv_cache_fp8_kernels.py"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
        lines = (r.stdout + r.stderr).strip().splitlines()
        fails = [ln for ln in lines if ln.startswith("FAILED")]
        return "\n".join(fails + lines[-1:])
    except subprocess.TimeoutExpired:
        return "tests: timed out after 150 s"


def run_decode(out_dir: str) -> list[tuple[str, str]]:
    base = json.load(open(os.path.join(ROOT, "pagedllm/model_configs/llama3-8b/config.json")))
    quant = {"awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
             "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                      "checkpoint_format": "gptq"}}
    runs = [("bf16", ["--model", "pagedllm/model_configs/llama3-8b"]),
            ("fp8", ["--model", "pagedllm/model_configs/llama3-8b", "--quantization", "fp8"])]
    for name, qc in quant.items():
        d = os.path.join(out_dir, f"llama3-8b-{name}")
        os.makedirs(d, exist_ok=True)
        json.dump({**base, "quantization_config": qc}, open(os.path.join(d, "config.json"), "w"))
        runs.append((name, ["--model", d]))
    rows = []
    for tag, args in runs:
        js = os.path.join(out_dir, f"lat_{tag}.json")
        cmd = [sys.executable, "-m", "pagedllm", "bench", "latency", *args, "--load-format", "dummy",
               "--skip-tokenizer-init", "--batch-size", "1", "--input-len", "128", "--output-len", "257",
               "--max-model-len", "4096", "--num-iters", "3", "--output-json", js]
        t = time.time()
        try:
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=75,
                               env={**os.environ, "PYTHONPATH": ROOT})
            if r.returncode == 0 and os.path.exists(js):
                d = json.load(open(js))
                rows.append((tag, f"{d['decode_step_time'] * 1e3:.3f} ms (p50 {d['decode_step_time_p50'] * 1e3:.3f}, "
                                  f"floor {d['floor_decode_step_time'] * 1e3:.3f}) in {time.time() - t:.0f} s"))
            else:
                rows.append((tag, "failed: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])))
        except subprocess.TimeoutExpired:
            rows.append((tag, "timed out after 75 s"))
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
    kinds = list(dict.fromkeys(r["kernel"] for r in kern))
    print("| linear | M | " + " | ".join(kinds) + " |")
    print("|---|---|" + "---|" * len(kinds))
    for (shape, m), group in itertools.groupby(kern, key=lambda r: (r["shape"], r["m"])):
        cells = {r["kernel"]: r for r in group}
        row = []
        for kname in kinds:
            r = cells.get(kname)
            row.append("" if r is None else r.get("error") or
                       (f"{r['us']:.1f}" + (f" ({r['err']:.0e})" if r.get("err") is not None else "") + r.get("note", "")))
        print(f"| {shape} | {m} | " + " | ".join(row) + " |")
    bad = [r for r in kern if r.get("error") or (r.get("err") is not None and not r["err"] <= 2e-2)]
    print(f"\nkernels within 2e-2 of their reference: {len(kern) - len(bad)}/{len(kern)}"
          + "".join(f"\n  OFF: {r['shape']} M={r['m']} {r['kernel']}: {r.get('error') or r['err']}" for r in bad))
    print("\n## batch-1 decode step, Llama-3.1-8B shape (dummy weights)")
    for tag, res in decode:
        print(f"| {tag} | {res} |")
    print(f"\n## GPU kernel tests\n{tests}")
    print(f"\ntotal {time.time() - T0:.0f} s; results in {a.out}/results.json")


if __name__ == "__main__":
    main()
