"""What the quantized-linear GPU scripts (gpu_quant_speed.py, gpu_wna16_sweep.py, gpu_w8a8_sweep.py) share:
the kernel tests in a subprocess, the Llama-3.1-8B int4 model directories and their batch-1 decode
bench, and the kernels table. No torch here: the decode runs happen before the calling process
touches the GPU.

Import it from a script run as `python3 scripts/NAME.py` (its folder is then on sys.path).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# AWQ and GPTQ int4 g128, as their checkpoints' quantization_config says it.
INT4_QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
}


def run_pytest(files: list[str], timeout: float) -> str:
    """The test files on this machine's GPU in a subprocess: the FAILED lines and the summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        lines = (r.stdout + r.stderr).strip().splitlines()
        return "\n".join([ln for ln in lines if ln.startswith("FAILED")] + lines[-1:])
    except subprocess.TimeoutExpired:
        return f"tests: timed out after {timeout:.0f} s"


def int4_model_dirs(out_dir: str) -> dict[str, str]:
    """{"awq": dir, "gptq": dir}: the Llama-3.1-8B config with each int4 quantization_config, written
    under out_dir (for `--load-format dummy`)."""
    base = json.load(open(os.path.join(ROOT, "pagedllm/model_configs/llama3-8b/config.json")))
    dirs = {}
    for name, qc in INT4_QUANT_CONFIGS.items():
        d = dirs[name] = os.path.join(out_dir, f"llama3-8b-{name}")
        os.makedirs(d, exist_ok=True)
        json.dump({**base, "quantization_config": qc}, open(os.path.join(d, "config.json"), "w"))
    return dirs


def bench_decode(model_args: list[str], out_json: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """`pagedllm bench latency` at batch 1 (128 in, 257 out, dummy weights) in its own process: the
    decode step's mean, p50 and floor, or why it failed."""
    cmd = [sys.executable, "-m", "pagedllm", "bench", "latency", *model_args, "--load-format", "dummy",
           "--skip-tokenizer-init", "--batch-size", "1", "--input-len", "128", "--output-len", "257",
           "--max-model-len", "4096", "--num-iters", "3", "--output-json", out_json]
    t = time.time()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
        if r.returncode == 0 and os.path.exists(out_json):
            d = json.load(open(out_json))
            return (f"{d['decode_step_time'] * 1e3:.3f} ms (p50 {d['decode_step_time_p50'] * 1e3:.3f}, "
                    f"floor {d['floor_decode_step_time'] * 1e3:.3f}) in {time.time() - t:.0f} s")
        return "failed: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"


def print_kernel_table(kern: list[dict]) -> None:
    """One row per (linear, M), one column per kernel: us (err) or the error; then how many kernels
    are within 2e-2 of their reference, naming the others."""
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
