"""W8A8 / W8A16 kernels on the H200 (issue 19): correctness and times at the Llama-3.1-8B linears, and the
best path per (linear, M). One call, ~3-4 minutes on one H200 (torch 2.11, Triton 3.6):

    python3 scripts/gpu_w8a8_sweep.py [--out DIR] [--budget 200] [--hard 320] [--skip-tests]
    python3 scripts/gpu_w8a8_sweep.py --w1 int8[,fp8,fp8-kvfp8,bf16]    (only W1 runs, ~40 s each)

attn     decode attention with a bf16 and an fp8 KV cache (W1-like batches): paged_attention vs its
         reference, paged and fused decode kernels timed (~15 s)
check    every new kernel against its torch reference, qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
         down 4096x14336, M = 1, 4, 16, 64, 256, 512, 2048, 8192 (W8A16 up to its M <= 64):
         w8a8_gemm (Triton int8 / fp8 tile GEMM) vs scaled_mm_ref, w8a16_linear vs w8a16_linear_ref
         (max |out - ref| / max |ref| <= 2e-2)
time     bf16 (the model's dense path), fp8 / int8 through `w8a8_linear` on each path ("cublas" =
         quant + torch._scaled_mm / _int_mm + epilogue, "triton" = quant + w8a8_gemm, "w8a16"), the
         default dispatch ("auto"), and config variants of w8a8_gemm (M >= 16) and w8a16_linear
         (M <= 64): CUDA-graph replays of 20 calls (5 at M >= 2048) rotating over >= 150 MB of weight
         copies (scripts/gpu_quant_speed_kernels.graph_us), microseconds per call
tests    the W8A8 kernel tests on the GPU (subprocess, ~30-60 s; last, skipped if the budget is spent)
Tables last: every timing, then per (linear, M) the best fp8 and best int8 path with their speed vs
bf16 (bf16 us / path us) — the numbers `scaled_mm.W8A16_MAX_M` / `TRITON_MAX_M` and the config
functions are set from.
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
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
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
SHAPES = [("gate_up", 28672, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096), ("o", 4096, 4096)]
MS = [1, 4, 16, 64, 256, 512, 2048, 8192]
TILES = [(16, 64, 256, 8, 4, 4), (16, 128, 128, 8, 4, 4), (32, 64, 256, 8, 4, 4), (64, 64, 256, 8, 4, 4),
         (64, 128, 128, 8, 4, 4), (128, 128, 128, 8, 8, 4), (128, 256, 128, 8, 8, 3), (128, 128, 256, 8, 8, 3),
         (256, 128, 128, 8, 8, 3), (64, 256, 128, 8, 4, 3), (128, 256, 128, 8, 8, 4),
         # the TMA kernel (W8A8Config.TMA), at M >= 64 only
         (64, 128, 128, 8, 4, 4, True), (128, 128, 128, 8, 8, 4, True), (128, 256, 128, 8, 8, 3, True),
         (128, 128, 256, 8, 8, 3, True), (256, 128, 128, 8, 8, 3, True), (64, 256, 128, 8, 4, 3, True),
         (128, 256, 128, 8, 8, 4, True)]
GEMVS = [(16, 512, 512, 4, 3, False), (8, 512, 1024, 4, 3, False), (32, 256, 512, 4, 3, False),
         (64, 256, 256, 4, 4, True), (32, 256, 512, 4, 4, True), (128, 128, 256, 4, 4, True),
         (64, 128, 512, 4, 4, True), (128, 256, 256, 8, 3, True), (32, 512, 256, 4, 3, True)]
T0 = time.time()
DEVICE = "cuda"  # a CPU smoke run of the script logic (interpreter) sets "cpu"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", flush=True)


def run_tests() -> str:
    from _quant_report import run_pytest

    return run_pytest(["tests/kernels/test_w8a8_gemm.py", "tests/kernels/test_w8a16_gemv.py",
                       "tests/kernels/test_scaled_mm.py", "tests/kernels/test_quant_act.py"], timeout=120)


def sweep(deadline: float, hard: float = float("inf")) -> list[dict]:
    """Config variants stop once time.time() passes `deadline`; past `hard` the remaining (linear, M)
    cells are skipped altogether, so the tables still print inside the caller's time limit."""
    import torch
    from gpu_quant_speed_kernels import copies_for, graph_us, rel_err

    from pagedllm.kernels import scaled_mm
    from pagedllm.kernels.quant_act import quantize_activation_triton
    from pagedllm.kernels.scaled_mm import FP8_DTYPE, quantize_activation, scaled_mm_ref, w8a8_linear
    from pagedllm.kernels.w8a8_gemm import W8A8Config, w8a8_gemm
    from pagedllm.kernels.w8a16_gemv import W8A16Config, w8a16_linear, w8a16_linear_ref
    from pagedllm.quantization.base import _dense_linear

    rows: list[dict] = []
    qnames = {FP8_DTYPE: "fp8", torch.int8: "int8"}
    for name, n, k in SHAPES:
        w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
        bf16 = [w] + [w.clone() for _ in range(copies_for(n * k * 2) - 1)]
        quant = {}
        for qd in (FP8_DTYPE, torch.int8):
            wq, s = quantize_activation(w, qd)
            quant[qd] = [(wq.clone(), s.flatten().clone()) for _ in range(copies_for(n * k))]
        for m in MS:
            if time.time() > hard:
                log(f"{name} M={m}: skipped (past the hard time limit)")
                continue
            reps = 20 if m <= 256 else 5
            x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
            late = time.time() > deadline  # past the budget: the paths only, no config variants
            cases = [("bf16", "bf16", "", lambda i: _dense_linear(x, bf16[i], None), len(bf16), None)]
            for qd, qn in qnames.items():
                ws = quant[qd]
                xq, xs = quantize_activation(x, qd)
                ref8 = scaled_mm_ref(xq, ws[0][0], xs, ws[0][1], None, torch.float32)
                ref16 = w8a16_linear_ref(x, ws[0][0], ws[0][1]).float() if m <= 64 else None
                cases.append((qn, "quant only", "", lambda i, qd=qd: quantize_activation_triton(x, qd), 1, None))
                cases.append((qn, "auto", scaled_mm.choose_path(m, n, k, qd),
                              lambda i, qd=qd: w8a8_linear(x, *quant[qd][i], None, None), len(ws),
                              ref16 if scaled_mm.choose_path(m, n, k, qd) == "w8a16" else ref8))
                for path in ("cublas", "triton") + (("w8a16",) if m <= 64 else ()):
                    cases.append((qn, path, "default", lambda i, qd=qd, path=path: w8a8_linear(
                        x, *quant[qd][i], None, None, path=path), len(ws), ref16 if path == "w8a16" else ref8))
                if late:
                    continue
                for t in TILES:
                    if m >= 16 and t[0] <= max(16, m) and (m < 256 or t[0] >= 64) and (m >= 64 or len(t) < 7):
                        cfg = W8A8Config(*t)
                        cases.append((qn, "triton", str(t), lambda i, qd=qd, cfg=cfg: _quant_gemm(
                            x, qd, quant[qd][i], cfg, quantize_activation_triton, w8a8_gemm), len(ws), ref8))
                if m <= 64:
                    for g in GEMVS:
                        if g[5] or m == 1:
                            cfg16 = W8A16Config(*g)
                            cases.append((qn, "w8a16", str(g), lambda i, qd=qd, cfg16=cfg16: w8a16_linear(
                                x, *quant[qd][i], None, config=cfg16), len(ws), ref16))
            for qn, path, cfg, call, copies, ref in cases:
                row = {"shape": name, "n": n, "k": k, "m": m, "q": qn, "path": path, "config": cfg}
                try:
                    out = call(0)
                    if ref is not None:
                        row["err"] = rel_err(out, ref)
                    row["us"], row["note"] = graph_us(call, copies, reps)
                except Exception as e:  # noqa: BLE001 - one failing variant must not hide the others
                    row["error"] = f"ERR {type(e).__name__}: {str(e)[:100]}"
                rows.append(row)
            mine = [r for r in rows if r["shape"] == name and r["m"] == m]
            log(f"{name} M={m}: " + ", ".join(
                f"{r['q']} {r['path']} {r['us']:.1f}" for r in mine if "us" in r and r["config"] in ("", "default")))
        bf16 = quant = None  # noqa: F841 - free this shape's weights before the next
        torch.cuda.empty_cache()
    return rows


def attention_rows() -> list[dict]:
    """Decode attention with a bf16 and an fp8 (e4m3, scale 1) KV cache, Llama-3.1-8B heads (32 / 8,
    head_dim 128), W1-like batches (scripts/attn_sweep.case): `paged_attention` against its torch
    reference on the same cache, and the fused decode kernel the CUDA graphs run (rope + cache write +
    attention), timed in CUDA graphs. An fp8 cache reads half the bytes: it should be faster."""
    import torch
    from attn_sweep import case
    from gpu_quant_speed_kernels import graph_us, rel_err

    from pagedllm.kernels.decode_attention import decode_attention_fused
    from pagedllm.kernels.paged_attention import paged_attention, paged_attention_ref
    from pagedllm.kernels.rotary import build_cos_sin_cache

    rows = []
    cos_sin = build_cos_sin_cache(128, 4096).to(DEVICE)
    for kind in ("decode256", "decode64"):
        q, cache16, md, kv_bytes = case(kind, 32, 8)
        n = q.shape[0]
        qkv = torch.randn(n, 48 * 128, device=DEVICE, dtype=torch.bfloat16)
        positions = (md.seq_lens[:n] - 1).to(torch.int64)
        for name, cache in (("bf16", cache16), ("fp8", cache16.to(torch.float8_e4m3fn))):
            row = {"case": kind, "cache": name, "kv_gb": kv_bytes / (2 if name == "fp8" else 1) / 1e9}
            try:
                row["err"] = rel_err(paged_attention(q, cache, md, 0.088), paged_attention_ref(q, cache, md, 0.088))
                row["paged_us"], _ = graph_us(lambda i, cache=cache: paged_attention(q, cache, md, 0.088), 1, 20)
                work = cache.clone()  # the fused kernel writes this step's K / V into its cache
                row["fused_us"], _ = graph_us(lambda i, work=work: decode_attention_fused(
                    qkv, positions, cos_sin, work, md, 0.088, 32, 8, 128), 1, 20)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"ERR {type(e).__name__}: {str(e)[:100]}"
            rows.append(row)
            log(f"attention {kind} {name}: {row}")
        rows += _fp8_tiles(kind, q, cache16.to(torch.float8_e4m3fn), md, kv_bytes / 2)
        torch.cuda.empty_cache()
    return rows


def _fp8_tiles(kind, q, cache, md, kv_bytes) -> list[dict]:
    """paged_attention on the fp8 cache with other (BLOCK_M, TILE_N, warps, stages): a 1-byte cache
    tile is half a bf16 one's shared memory, so longer / deeper tiles may stream faster."""
    from gpu_quant_speed_kernels import graph_us, rel_err

    from pagedllm.kernels import paged_attention as pa

    default = pa._tile_config
    ref = pa.paged_attention(q, cache, md, 0.088)
    rows = []
    for tn, w, st in itertools.product((64, 128, 256), (4, 8), (2, 3)):
        pa._tile_config = lambda *_a, tn=tn, w=w, st=st, **_k: (16, 4, tn, w, st)
        row = {"case": kind, "cache": f"fp8 tn{tn} w{w} s{st}", "kv_gb": kv_bytes / 1e9}
        try:
            row["err"] = rel_err(pa.paged_attention(q, cache, md, 0.088), ref)
            row["paged_us"], _ = graph_us(lambda i: pa.paged_attention(q, cache, md, 0.088), 1, 20)
            row["fused_us"] = float("nan")
        except Exception as e:  # noqa: BLE001 - out of shared memory etc.
            row["error"] = f"ERR {type(e).__name__}: {str(e)[:80]}"
        finally:
            pa._tile_config = default
        rows.append(row)
    ok = [r for r in rows if "paged_us" in r]
    if ok:
        log(f"attention {kind} fp8 tiles: best {min(ok, key=lambda r: r['paged_us'])}")
    return rows


def _quant_gemm(x, qd, wts, cfg, quant_fn, gemm_fn):
    xq, xs = quant_fn(x, qd)
    return gemm_fn(xq, wts[0], xs, wts[1], None, x.dtype, config=cfg)


# The W1 runs of `--w1` (pagedllm only): tag -> (model dir or quantization_config to add, extra flags).
INT8_CONFIG = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"],
                                             "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                         "strategy": "channel"},
                                             "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                   "strategy": "token", "dynamic": True}}}}
W1_RUNS = {"bf16": (None, []), "fp8": (None, ["--quantization", "fp8"]),
           "fp8-kvfp8": (None, ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]), "int8": (INT8_CONFIG, [])}


def run_w1(tags: list[str], out: str) -> None:
    """`pagedllm bench throughput --dataset w1` on the Llama-3.1-8B shape (dummy weights), one fresh
    process per tag (~35-45 s each on the H200: ~20 s to engine ready, ~11-13 s of W1)."""
    base = json.load(open(os.path.join(ROOT, "pagedllm/model_configs/llama3-8b/config.json")))
    results = []
    for tag in tags:
        qc, extra = W1_RUNS[tag]
        model = os.path.join(ROOT, "pagedllm/model_configs/llama3-8b")
        if qc is not None:
            model = os.path.join(out, f"llama3-8b-{tag}")
            os.makedirs(model, exist_ok=True)
            json.dump({**base, "quantization_config": qc}, open(os.path.join(model, "config.json"), "w"))
        js = os.path.join(out, f"w1_{tag}.json")
        cmd = [sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", model, "--load-format", "dummy",
               "--skip-tokenizer-init", "--dataset", "w1", "--max-model-len", "4096", "--output-json", js, *extra]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170,
                           env={**os.environ, "PYTHONPATH": ROOT})
        ok = r.returncode == 0 and os.path.exists(js)
        results.append((tag, f"{json.load(open(js))['output_tokens_per_second']:.1f}" if ok else
                        "failed: " + " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])))
        log(f"W1 {tag}: {results[-1][1]}")
    print("\n| pagedllm W1, Llama-3.1-8B shape | output tok/s |\n|---|---|")
    for tag, res in results:
        print(f"| {tag} | {res} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=tempfile.mkdtemp(prefix="w8a8_sweep_"))
    ap.add_argument("--budget", type=float, default=200.0, help="seconds after which config variants stop")
    ap.add_argument("--hard", type=float, default=320.0, help="seconds after which GEMM cells are skipped")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--w1", default="", help=f"only these W1 runs, comma-separated, of {sorted(W1_RUNS)}")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.w1:
        run_w1(a.w1.split(","), a.out)
        return
    attn = attention_rows()
    rows = sweep(T0 + a.budget, T0 + a.hard)
    # The pytest files last, and only inside the time budget (the in-process check above covers the
    # kernels at the model's shapes; these add the edges: ragged shapes, bias, graph capture per path).
    tests = "not run" if a.skip_tests or time.time() - T0 > a.budget + 20 else run_tests()
    log(f"tests: {tests}")
    json.dump({"rows": rows, "attention": attn, "tests": tests}, open(os.path.join(a.out, "results.json"), "w"),
              indent=1)

    bad = [r for r in rows if r.get("error") or (r.get("err") is not None and not r["err"] <= 2e-2)]
    checked = [r for r in rows if r.get("err") is not None]
    print("\n## every timing (us per call; err = max|out - ref| / max|ref|)")
    print("| linear | M | q | path | config | us | err |\n|---|---|---|---|---|---|---|")
    for r in rows:
        us = r.get("error") or f"{r['us']:.1f}{r.get('note', '')}"
        err = f"{r['err']:.1e}" if r.get("err") is not None else ""
        print(f"| {r['shape']} | {r['m']} | {r['q']} | {r['path']} | {r['config']} | {us} | {err} |")
    print("\n## best path per (linear, M): us, and bf16 us / that us (> 1 = faster than bf16)")
    print("| linear | M | bf16 | fp8 auto | fp8 best | fp8 best path / config | int8 auto | int8 best | "
          "int8 best path / config |\n|---|---|---|---|---|---|---|---|---|")
    for name, _, _ in SHAPES:
        for m in MS:
            mine = [r for r in rows if r["shape"] == name and r["m"] == m and "us" in r
                    and not (r.get("err") is not None and r["err"] > 2e-2)]
            base = next((r["us"] for r in mine if r["q"] == "bf16"), None)
            if base is None:
                continue
            cells = [f"{base:.1f}"]
            for qn in ("fp8", "int8"):
                auto = next((r for r in rows if r["shape"] == name and r["m"] == m and r["q"] == qn
                             and r["path"] == "auto" and "us" in r), None)
                best = min((r for r in mine if r["q"] == qn and r["path"] not in ("auto", "quant only")), key=lambda r: r["us"], default=None)
                off = " OFF" if auto and auto.get("err") is not None and auto["err"] > 2e-2 else ""
                cells.append(f"{auto['us']:.1f} ({auto['config']}, {base / auto['us']:.2f}x){off}" if auto else "")
                cells.append(f"{best['us']:.1f} ({base / best['us']:.2f}x)" if best else "")
                cells.append(f"{best['path']} {best['config']}" if best else "")
            print(f"| {name} | {m} | " + " | ".join(cells) + " |")
    print(f"\nchecked against references: {len(checked) - len([r for r in bad if 'err' in r])}/{len(checked)} "
          "within 2e-2" + "".join(f"\n  OFF: {r['shape']} M={r['m']} {r['q']} {r['path']} {r['config']}: "
                                  f"{r.get('error') or r['err']}" for r in bad))
    print("\n## decode attention, bf16 vs fp8 KV cache (us, CUDA graphs; err vs torch reference)")
    print("| case | cache | KV GB | paged_attention us | TB/s | fused decode us | err |\n|---|---|---|---|---|---|---|")
    for r in attn:
        if "error" in r:
            print(f"| {r['case']} | {r['cache']} | {r['kv_gb']:.2f} | {r['error']} | | | |")
            continue
        print(f"| {r['case']} | {r['cache']} | {r['kv_gb']:.2f} | {r['paged_us']:.1f} | "
              f"{r['kv_gb'] * 1e3 / r['paged_us']:.2f} | {r['fused_us']:.1f} | {r['err']:.1e} |")
    print(f"\n## GPU kernel tests\n{tests}")
    print(f"\ntotal {time.time() - T0:.0f} s; results in {a.out}/results.json")


if __name__ == "__main__":
    main()
