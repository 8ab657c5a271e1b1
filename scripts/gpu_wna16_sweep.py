"""Int4 W4A16 kernels on one H200 (issue 19): correctness, times, a config sweep of the tensor-core
kernel, and the batch-1 decode step of the Llama-3.1-8B shape for awq / gptq. < 4 minutes:

    python3 scripts/gpu_wna16_sweep.py [--out DIR] [--sections decode,kernels,sweep] [--budget S]

decode   `pagedllm bench latency` batch 1, 128 in / 257 out, dummy weights, for awq and gptq (int4 g128)
         with the default dispatch, and awq with PAGEDLLM_WNA16_TC=0 (the FMA GEMV / tile path before
         kernels/wna16_tc.py); each in its own process, before this process touches the GPU
kernels  qkv / o / gate_up / down at M = 1 .. 2048: bf16 cuBLAS (the model's dense path), the old
         int4 path (FMA GEMV <= 16, tile kernel < 128, dequantize + cuBLAS from 128), the tensor-core
         kernel (its default config; also its shift + convert unpack at M = 1), dequantize + cuBLAS,
         the default dispatch; act-order (perm) at M = 1 / 16 / 256; GPTQ-sym zeros (all 8) at M = 1;
         each held to its torch reference (max |err| / max |ref| <= 2e-2)
sweep    tensor-core configs (BLOCK_M, BLOCK_N, SPLIT_K, warps, stages, X_TILE, PRESCALE) at M = 1, 16,
         64, 256
tests    tests/kernels/test_wna16_tc.py and test_wna16_gemm.py on the GPU (subprocess, last)
Times: CUDA-graph replays of 20 calls (5 at M = 2048) rotating over >= 150 MB of weight copies (L2
cannot serve repeats), microseconds per call; GB/s counts the packed int4 words only. Tables last.
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

from _quant_report import bench_decode, int4_model_dirs, print_kernel_table, run_pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [1, 16, 64, 128, 256, 2048, 2, 4, 8, 32]  # most telling first (the time budget cuts the tail)
G = 128
DEV = "cuda"  # a CPU smoke run of the flow (interpreter) sets "cpu"
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def run_decode(out_dir: str) -> list[tuple[str, str]]:
    dirs = int4_model_dirs(out_dir)
    runs = [(name, d, {}) for name, d in dirs.items()]
    runs.append(("awq, PAGEDLLM_WNA16_TC=0", dirs["awq"], {"PAGEDLLM_WNA16_TC": "0"}))
    rows = []
    for tag, model, env in runs:
        rows.append((tag, bench_decode(["--model", model], os.path.join(out_dir, f"lat_{len(rows)}.json"), timeout=100,
                                       env=env)))
        log(f"decode {tag}: {rows[-1][1]}")
    return rows


def run_tests() -> str:
    """The int4 kernel test files on the GPU (the PTX unpack included), in a subprocess."""
    return run_pytest(["tests/kernels/test_wna16_tc.py", "tests/kernels/test_wna16_gemm.py"], timeout=40)


def _weights(n: int, k: int):
    import torch
    from gpu_quant_speed_kernels import copies_for

    from pagedllm.kernels.wna16_gemm import pack_along_k

    dev = torch.device(DEV)
    w = (torch.randn(n, k, device=dev) / k**0.5).to(torch.bfloat16)
    bf16 = [w] + [w.clone() for _ in range(copies_for(n * k * 2) - 1)]
    qw = pack_along_k(torch.randint(0, 16, (k, n), device=dev), 4)
    sc = (torch.rand(k // G, n, device=dev) * 0.01 + 0.001).to(torch.bfloat16)
    z = torch.randint(0, 16, (k // G, n), device=dev, dtype=torch.uint8)
    int4 = [(qw.clone(), sc.clone(), z.clone()) for _ in range(copies_for(n * k / 2))]
    sym = (qw, sc, torch.full_like(z, 8))
    return bf16, int4, sym, torch.randperm(k, device=dev).to(torch.int32)


def _old_path(x, qw, sc, z, perm=None):
    """The int4 dispatch before the tensor-core kernel (what PAGEDLLM_WNA16_TC=0 runs)."""
    from pagedllm.kernels.wna16_gemm import DEQUANT_MIN_M, wna16_config, wna16_linear
    from pagedllm.kernels.wna16_gemv import MAX_M, wna16_gemv

    m, k = x.shape
    if m <= MAX_M:
        return wna16_gemv(x, qw, sc, z, 4, G, perm=perm)
    if m < DEQUANT_MIN_M:
        return wna16_linear(x, qw, sc, z, 4, G, perm=perm, config=wna16_config(m, qw.shape[1], k, G, 4))
    return wna16_linear(x, qw, sc, z, 4, G, perm=perm, dequant_min_m=1)


def kernel_rows(deadline: float) -> list[dict]:
    import torch
    from gpu_quant_speed_kernels import time_cases

    from pagedllm.kernels.wna16_gemm import wna16_linear, wna16_linear_ref
    from pagedllm.kernels.wna16_tc import KERNEL_MAX_M, tc_config, wna16_tc_linear
    from pagedllm.quantization.base import _dense_linear

    rows: list[dict] = []
    weights = {name: _weights(n, k) for name, n, k in SHAPES}  # ~1.4 GB in all
    # M outer: a run cut by the time budget loses the large M of every linear, not whole linears
    for m, (name, n, k) in itertools.product(MS, SHAPES):
        bf16, int4, sym, perm = weights[name]
        words = n * k / 2
        if time.time() > deadline:
            log(f"kernels: M={m} {name} skipped (time budget)")
            continue
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = wna16_linear_ref(x.float(), *int4[0], 4, G)
        cases = [("bf16", lambda i, x=x: _dense_linear(x, bf16[i], None), len(bf16), None, n * k * 2),
                 ("old int4", lambda i, x=x: _old_path(x, *int4[i]), len(int4), ref, words)]
        if m <= KERNEL_MAX_M:
            cases.append(("tc", lambda i, x=x: wna16_tc_linear(x, *int4[i], G), len(int4), ref, words))
        if m == 1:
            cases.append(("tc no-asm", lambda i, x=x: wna16_tc_linear(x, *int4[i], G, use_asm=False),
                          len(int4), ref, words))
            xt = tc_config(1, n, k)._replace(X_TILE=True)
            cases.append(("tc x-tile", lambda i, x=x, xt=xt: wna16_tc_linear(x, *int4[i], G, config=xt),
                          len(int4), ref, words))
            ref_sym = wna16_linear_ref(x.float(), *sym, 4, G)
            cases.append(("tc gptq-sym", lambda i, x=x: wna16_tc_linear(x, *sym, G), 1, ref_sym, words))
        if m >= 16:
            cases.append(("dequant+cuBLAS", lambda i, x=x: wna16_linear(x, *int4[i], 4, G, dequant_min_m=1),
                          len(int4), ref, words))
        cases.append(("dispatch", lambda i, x=x: wna16_linear(x, *int4[i], 4, G), len(int4), ref, words))
        if m in (1, 16, 256):
            ref_p = wna16_linear_ref(x.float(), *int4[0], 4, G, perm=perm)
            cases.append(("old int4 perm", lambda i, x=x: _old_path(x, *int4[i], perm=perm), len(int4), ref_p, words))
            cases.append(("tc perm", lambda i, x=x: wna16_tc_linear(x, *int4[i], G, perm=perm),
                          len(int4), ref_p, words))
        time_cases(rows, name, m, cases, 20 if m <= 256 else 5)
        log(f"kernels {name} M={m}: " + ", ".join(
            f"{r['kernel']} {r['us']:.1f}" if "us" in r else f"{r['kernel']} {r.get('error')}"
            for r in rows if r["shape"] == name and r["m"] == m))
    weights = None  # noqa: F841 - freed before the sweep
    torch.cuda.empty_cache()
    rows.sort(key=lambda r: ([s[0] for s in SHAPES].index(r["shape"]), r["m"]))
    return rows


def sweep_rows(start: float, end: float) -> list[dict]:
    """Each of the 4 Ms gets a quarter of [start, end)."""
    import torch
    from gpu_quant_speed_kernels import graph_us, rel_err

    from pagedllm.kernels.wna16_gemm import wna16_linear_ref
    from pagedllm.kernels.wna16_tc import tc_config, wna16_tc_linear

    rows: list[dict] = []
    order = [SHAPES[3], SHAPES[2], SHAPES[0], SHAPES[1]]
    weights = {name: _weights(n, k)[1] for name, n, k in order}
    ms = (1, 16, 64, 256)
    for m, (name, n, k) in itertools.product(ms, order):  # M outer: see kernel_rows
        deadline = start + (ms.index(m) + 1) * (end - start) / len(ms)
        if time.time() > deadline:
            log(f"sweep: M={m} {name} skipped (time budget)")
            continue
        int4 = weights[name]
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        ref = wna16_linear_ref(x.float(), *int4[0], 4, G)
        default = tc_config(m, n, k)
        found = []
        for cfg in dict.fromkeys([default, *_configs(m, k)]):
            if time.time() > deadline:
                break
            cname = _cfg_name(cfg, m)
            try:
                err = rel_err(wna16_tc_linear(x, *int4[0], G, config=cfg), ref)
                us, _ = graph_us(lambda i, x=x, cfg=cfg: wna16_tc_linear(x, *int4[i], G, config=cfg), len(int4), 20)
                found.append({"config": cname, "us": us, "err": err, "gbs": n * k / 2 / us / 1e3})
            except Exception as e:  # noqa: BLE001
                log(f"tc {cname}: {type(e).__name__}: {str(e)[:100]}")
        ok = sorted((r for r in found if r["err"] <= 2e-2), key=lambda r: r["us"])
        dname = _cfg_name(default, m)
        for r in ok[:4] + [dict(r, config="default " + r["config"]) for r in found if r["config"] == dname]:
            rows.append(dict(r, shape=name, m=m))
        for r in [r for r in found if not r["err"] <= 2e-2][:2]:
            rows.append(dict(r, shape=name, m=m, config=f"OFF err {r['err']:.2g} {r['config']}"))
        log(f"sweep {name} M={m}: best {ok[0] if ok else None}; default {dname}")
    weights = None  # noqa: F841
    torch.cuda.empty_cache()
    rows.sort(key=lambda r: ([s[0] for s in order].index(r["shape"]), r["m"]))
    return rows


def _cfg_name(cfg, m: int) -> str:
    bm = cfg.BLOCK_M or min(64, max(16, 1 << (m - 1).bit_length()))
    return f"BM{bm} BN{cfg.BLOCK_N} split{cfg.SPLIT_K} w{cfg.num_warps} s{cfg.num_stages}" + \
        (" xtile" if cfg.X_TILE else "") + (" prescale" if cfg.PRESCALE else "")


def _configs(m: int, k: int) -> list:
    """The TCConfigs swept at M: (BLOCK_M, BLOCK_N, warps, stages, X_TILE, PRESCALE) x splits that leave
    >= 1 step per split."""
    from pagedllm.kernels.wna16_tc import TCConfig

    if m == 1:
        space = [(16, 128, 4, 3, False, False), (16, 128, 8, 3, False, False), (16, 256, 8, 3, False, False),
                 (16, 256, 8, 4, False, False), (16, 128, 4, 3, True, False), (16, 256, 8, 3, True, False)]
        splits = (2, 4, 8, 16)
    elif m == 16:
        space = [(16, bn, w, s, xt, False) for bn in (128, 256) for w, s in ((4, 3), (8, 3)) for xt in (False, True)]
        space += [(16, 128, 4, 3, True, True)]
        splits = (1, 2, 4)
    elif m == 64:
        space = [(64, 64, 4, 3, True, True), (64, 128, 4, 3, True, True), (64, 128, 8, 3, True, True),
                 (64, 64, 4, 4, True, True), (64, 128, 4, 3, True, False)]
        splits = (1, 2, 4)
    else:
        space = [(128, 128, 8, 3, True, True), (128, 64, 8, 3, True, True), (128, 256, 8, 3, True, True),
                 (64, 128, 4, 3, True, True), (128, 128, 8, 4, True, True), (128, 128, 8, 3, True, False)]
        splits = (1, 2)
    return [TCConfig(bn, split, w, s, BLOCK_M=bm, X_TILE=xt, PRESCALE=ps)
            for (bm, bn, w, s, xt, ps), split in itertools.product(space, splits) if split <= k // 128]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="wna16_"))
    ap.add_argument("--sections", default="decode,kernels,sweep,tests")
    ap.add_argument("--budget", type=float, default=120.0,
                    help="seconds for kernels + sweep after the decode runs (kernels get half, all without sweep)")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    os.makedirs(a.out, exist_ok=True)
    decode = run_decode(a.out) if "decode" in sections else []
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
    t1 = time.time()
    kern = kernel_rows(t1 + (a.budget / 2 if "sweep" in sections else a.budget)) if "kernels" in sections else []
    sweep = sweep_rows(t1 + a.budget / 2, t1 + a.budget) if "sweep" in sections else []
    if "tests" in sections:
        import torch

        torch.cuda.empty_cache()
    tests = run_tests() if "tests" in sections else "not run"
    json.dump({"kernels": kern, "sweep": sweep, "decode": decode, "tests": tests},
              open(os.path.join(a.out, "results.json"), "w"), indent=1)

    print("\n## tensor-core sweep (us; best first per linear / M, then the default)")
    print("| linear | M | config | us | int4 GB/s | err |")
    print("|---|---|---|---|---|---|")
    for r in sweep:
        print(f"| {r['shape']} | {r['m']} | {r['config']} | {r['us']:.1f} | {r['gbs']:.0f} | {r['err']:.0e} |")
    print("\n## kernels (us per call, CUDA graphs; (err) = max|out - ref| / max|ref|)")
    print_kernel_table(kern)
    print("\n## M = 1: int4 GB/s (packed words) and us per linear")
    print("| linear | bf16 us | old int4 us (GB/s) | tc us (GB/s) | best swept tc us (GB/s) |")
    print("|---|---|---|---|---|")
    for name, _, _ in SHAPES:
        cells = {r["kernel"]: r for r in kern if r["shape"] == name and r["m"] == 1 and "us" in r}
        best = min((r for r in sweep if r["shape"] == name and r["m"] == 1 and r["err"] <= 2e-2), key=lambda r: r["us"], default=None)

        def cell(r):
            return "" if r is None else f"{r['us']:.1f} ({r['gbs']:.0f})"
        print(f"| {name} | {cell(cells.get('bf16')).split(' ')[0]} | {cell(cells.get('old int4'))} | "
              f"{cell(cells.get('tc'))} | {cell(best)} |")
    print("\n## batch-1 decode step, Llama-3.1-8B shape (dummy weights; target <= 2.2 ms)")
    for tag, res in decode:
        print(f"| {tag} | {res} |")
    print(f"\n## GPU kernel tests (test_wna16_tc, test_wna16_gemm)\n{tests}")
    print(f"\ntotal {time.time() - T0:.0f} s; results in {a.out}/results.json")


if __name__ == "__main__":
    main()
