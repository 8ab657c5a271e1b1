"""Issue 19, batch-1 int4 on the H200 in one short call (< 120 s): the one-row streaming GEMV
(kernels/wna16_stream.py) against the tensor-core kernel and the FMA GEMV, then the 8B AWQ decode step.

    python3 scripts/gpu_wna16_stream.py [--only compile check time step]

compile  worker processes compile every kernel variant below at its shapes in parallel (Triton's disk cache)
check  every variant below == the fp32 reference at the Llama-3.1-8B shapes (M = 1; act-order once;
       M = 16 through wna16_linear, to see nothing else moved)
time   CUDA-graph replays rotating over >= 100 MB of weight copies (L2 cannot serve repeats): us and
       GB/s of int4 words + scales + zero points per shape and variant; bf16 cuBLAS, the bf16 GEMV
       and the bf16 LM head beside.
step   the 8B AWQ g128 dummy model (max_num_seqs 1: one captured graph; engine in-process), each int4
       shape on the fastest variant of `time` (use_best_configs), batch-1 decode steps of 128 in / 257
       out as `bench latency` times them, then one profiled batch: kernel time per step by name.
"""

# ruff: noqa: B023 - the lambdas are called within the iteration that made them
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _gpu_common import bench_w1, record, rotating_graph_us, run_sections  # noqa: E402

from pagedllm.envs import use_triton_cache_dir  # noqa: E402
from pagedllm.kernels.gemv import skinny_linear  # noqa: E402
from pagedllm.kernels.wna16_gemm import pack_along_k, wna16_linear, wna16_linear_ref  # noqa: E402
from pagedllm.kernels.wna16_gemv import wna16_gemv  # noqa: E402
from pagedllm.kernels.wna16_stream import StreamConfig, stream_config, wna16_stream_linear  # noqa: E402
from pagedllm.kernels.wna16_tc import tc_config, wna16_tc_linear  # noqa: E402

T0 = time.monotonic()
use_triton_cache_dir()  # the engine's cache directory, here and in the workers: the step finds these kernels
G = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
STREAM = {  # name -> config; s: per-row offsets, t: whole-step sums, p / q: the same with the next step prefetched
    "s128x1w4": StreamConfig(128, 1, 4), "s128x2w4": StreamConfig(128, 2, 4), "s128x4w4": StreamConfig(128, 4, 4),
    "s128x8w4": StreamConfig(128, 8, 4), "s256x4w8": StreamConfig(256, 4, 8), "s64x8w2": StreamConfig(64, 8, 2),
    "t128x2w4": StreamConfig(128, 2, 4, STEP_SUMS=True), "t128x4w4": StreamConfig(128, 4, 4, STEP_SUMS=True),
    "t128x8w4": StreamConfig(128, 8, 4, STEP_SUMS=True),
    "p128x2w4": StreamConfig(128, 2, 4, PREFETCH=True), "p128x4w4": StreamConfig(128, 4, 4, PREFETCH=True),
    "p128x8w4": StreamConfig(128, 8, 4, PREFETCH=True),
    "q128x4w4": StreamConfig(128, 4, 4, STEP_SUMS=True, PREFETCH=True),
    "q128x8w4": StreamConfig(128, 8, 4, STEP_SUMS=True, PREFETCH=True),
}


def variants(n: int, k: int) -> dict:
    """name -> call(x, qweight, scales, zeros, perm) for one (N, K) at M = 1."""
    tc = tc_config(1, n, k)
    out = {
        "tc": lambda x, w, s, z, p: wna16_tc_linear(x, w, s, z, G, perm=p, config=tc),
        "tc_xtile": lambda x, w, s, z, p: wna16_tc_linear(x, w, s, z, G, perm=p, config=tc._replace(X_TILE=True)),
        "tc_split2x": lambda x, w, s, z, p: wna16_tc_linear(x, w, s, z, G, perm=p,
                                                            config=tc._replace(SPLIT_K=2 * tc.SPLIT_K)),
        "fma_gemv": lambda x, w, s, z, p: wna16_gemv(x, w, s, z, 4, G, perm=p),
    }
    for name, cfg in STREAM.items():
        out[name] = lambda x, w, s, z, p, cfg=cfg: wna16_stream_linear(x, w, s, z, G, perm=p, config=cfg)
    return out


def weights(n: int, k: int, copies: int = 1, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(copies):
        q = torch.randint(0, 16, (k, n), device="cuda", generator=gen, dtype=torch.int32)
        s = (torch.rand(k // G, n, device="cuda", generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (k // G, n), device="cuda", generator=gen, dtype=torch.int32).to(torch.uint8)
        out.append((pack_along_k(q, 4), s, z))
        del q
    return out


def _warm(job: tuple[str, str]) -> str:
    """A worker: compile one variant at one shape (same dtypes and shapes as the timing, so the same
    cache keys) by calling it once; the bf16 GEMVs too."""
    shape, name = job
    n, k = SHAPES[shape]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    t0 = time.monotonic()
    try:
        (w, s, z), = weights(n, k)
        variants(n, k)[name](x, w, s, z, None)
        if name == "tc":  # M = 16 through the dispatch, and the act-order read of the stream default
            wna16_linear(torch.randn(16, k, device="cuda", dtype=torch.bfloat16), w, s, z, 4, G)
            wna16_linear(x, w, s, z, 4, G, perm=torch.randperm(k, device="cuda").to(torch.int32))
            skinny_linear(x, torch.randn(n, k, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the variant is then skipped where it fails again
        return f"{shape}/{name} FAILED {type(e).__name__}: {str(e)[:200]}"
    return f"{shape}/{name} {time.monotonic() - t0:.1f}s"


def precompile() -> None:
    # The stream kernels' compiled forms depend on K only (qkv, o, gate_up share K = 4096); the others
    # are warmed at every shape.
    jobs = [(shape, name) for shape in SHAPES for name in variants(*SHAPES[shape])
            if shape in ("qkv", "down") or name not in STREAM]
    t0 = time.monotonic()
    with mp.get_context("spawn").Pool(min(15, os.cpu_count() or 4)) as pool:
        done = pool.map(_warm, jobs, chunksize=1)
    print(f"precompiled {len(done)} kernels in {time.monotonic() - t0:.1f} s:", ", ".join(done), flush=True)


ERRS: dict[str, dict[str, float]] = {}  # shape -> variant -> max abs error / max |ref| (check)


def ok(shape: str, name: str) -> bool:
    """Whether a variant passed the check at this shape (or the check did not run)."""
    return ERRS.get(shape, {}).get(name, 0.0) < 1e-2


def check() -> None:
    torch.manual_seed(0)
    for shape, (n, k) in SHAPES.items():
        (w, s, z), = weights(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = wna16_linear_ref(x, w, s, z, 4, G).float()
        scale = ref.abs().max().item()
        errs = {}
        for name, call in variants(n, k).items():
            try:
                errs[name] = (call(x, w, s, z, None).float() - ref).abs().max().item() / scale
            except Exception as e:  # noqa: BLE001 - one broken variant must not hide the others
                errs[name] = float("inf")
                print(f"{shape}/{name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        errs["dispatch"] = (wna16_linear(x, w, s, z, 4, G).float() - ref).abs().max().item() / scale
        ERRS[shape] = errs
        print(f"{shape} rel errs: " + ", ".join(f"{nm} {e:.1e}" for nm, e in errs.items()), flush=True)
        worst = max(errs, key=errs.get)
        record(f"check {shape} M=1, {len(errs)} variants: worst rel err", f"{errs[worst]:.1e} ({worst})"
               + (" OK" if errs[worst] < 1e-2 else " FAIL"))
        if shape == "qkv":  # act-order (GPTQ desc_act): x read through perm
            perm = torch.randperm(k, device="cuda").to(torch.int32)
            refp = wna16_linear_ref(x, w, s, z, 4, G, perm=perm).float()
            e = (wna16_linear(x, w, s, z, 4, G, perm=perm).float() - refp).abs().max().item() / refp.abs().max().item()
            record("check qkv M=1 act-order (dispatch)", f"{e:.1e}" + (" OK" if e < 1e-2 else " FAIL"))
        x16 = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
        ref16 = wna16_linear_ref(x16, w, s, z, 4, G).float()
        e = (wna16_linear(x16, w, s, z, 4, G).float() - ref16).abs().max().item() / ref16.abs().max().item()
        record(f"check {shape} M=16 (dispatch)", f"{e:.1e}" + (" OK" if e < 1e-2 else " FAIL"))
        del w, s, z, ref


REPS = 24  # calls per timed graph


TABLE: dict[str, dict[str, float]] = {}


def time_kernels() -> None:
    for shape, (n, k) in SHAPES.items():
        nbytes = n * k // 2 + (k // G) * n * 3
        copies = max(2, min(12, math.ceil(100e6 / nbytes)))
        ws = weights(n, k, copies)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        row = TABLE.setdefault(shape, {})
        for name, call in variants(n, k).items():
            try:
                row[name] = rotating_graph_us(lambda i: call(x, *ws[i], None), copies, REPS)
            except Exception as e:  # noqa: BLE001
                row[name] = float("inf")
                print(f"time {shape}/{name} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        row["dispatch"] = rotating_graph_us(lambda i: wna16_linear(x, *ws[i], 4, G), copies, REPS)
        ws = None  # free the copies before the next shape
        wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(max(2, min(8, math.ceil(150e6 / (2 * n * k)))))]
        row["bf16_cublas"] = rotating_graph_us(lambda i: F.linear(x, wb[i]), len(wb), REPS)
        row["bf16_gemv"] = rotating_graph_us(lambda i: skinny_linear(x, wb[i]), len(wb), REPS)
        wb = None
        best = min((v, name) for name, v in row.items() if not name.startswith("bf16") and ok(shape, name))
        record(f"time {shape} {n}x{k} M=1", f"best {best[1]} {best[0]:.1f} us = {nbytes / best[0] / 1e3:.0f} GB/s; "
               f"dispatch {row['dispatch']:.1f}; tc {row['tc']:.1f}; bf16 gemv {row['bf16_gemv']:.1f}")
    lm = [torch.randn(128256, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    us = rotating_graph_us(lambda i: skinny_linear(x, lm[i]), 2, REPS)
    record("time lm_head bf16 128256x4096 M=1 (skinny_linear)", f"{us:.1f} us = {2 * 128256 * 4096 / us / 1e3:.0f} GB/s")
    lm = None
    names = list(next(iter(TABLE.values())))
    print("\n| us (GB/s of int4 words + scales + zeros) | " + " | ".join(TABLE) + " | per layer |")
    print("|---" * (len(TABLE) + 2) + "|")
    for name in names:
        cells = []
        for shape, (n, k) in SHAPES.items():
            nbytes = n * k // 2 + (k // G) * n * 3
            cells.append(f"{TABLE[shape][name]:.1f} ({nbytes / TABLE[shape][name] / 1e3:.0f})")
        print(f"| {name} | " + " | ".join(cells) + f" | {sum(TABLE[s][name] for s in SHAPES):.1f} |")
    best_layer = sum(min(v for nm, v in TABLE[s].items() if not nm.startswith("bf16") and ok(s, nm)) for s in SHAPES)
    record("int4 GEMVs per layer: best per shape / dispatch / tc",
           f"{best_layer:.1f} / {sum(TABLE[s]['dispatch'] for s in SHAPES):.1f} / "
           f"{sum(TABLE[s]['tc'] for s in SHAPES):.1f} us (x 32 layers)")
    for shape, (n, k) in SHAPES.items():
        sname = min((v, nm) for nm, v in TABLE[shape].items() if nm in STREAM and ok(shape, nm))[1]
        print(f"  {shape} ({n}, {k}): best stream {sname} = {STREAM[sname]}, default {stream_config(n, k)}", flush=True)


def use_best_configs() -> str:
    """Route each 8B (N, K) at M = 1 to this run's fastest variant (wna16_linear's one-row call is
    replaced in this process; the engine runs in-process for it): the step then shows what the
    measured table would give, before it is written into stream_config."""
    import pagedllm.kernels.wna16_gemm as wg

    best = {}
    for shape, (n, k) in SHAPES.items():
        row = {nm: v for nm, v in TABLE.get(shape, {}).items()
               if (nm in STREAM or nm.startswith(("tc", "fma"))) and ok(shape, nm)}
        if row:
            best[(n, k)] = min(row, key=row.get)
    stream = wg.wna16_stream_linear

    def one_row(x, qweight, scales, zeros, group_size, bias=None, perm=None, config=None, act=None):
        n, k = qweight.shape[1], qweight.shape[0] * 8
        name = best.get((n, k))
        if name in STREAM:
            return stream(x, qweight, scales, zeros, group_size, bias, perm, config=STREAM[name], act=act)
        if name is not None and name != "dispatch":
            if act is not None:  # the variants take the activation's output (SwiGLU's down projection)
                from pagedllm.kernels.activation import silu_and_mul

                x = silu_and_mul(x)
            out = variants(n, k)[name](x, qweight, scales, zeros, perm)
            return out if bias is None else out + bias
        return stream(x, qweight, scales, zeros, group_size, bias, perm, config=config, act=act)

    wg.wna16_stream_linear = one_row
    return ", ".join(f"{n}x{k}: {nm}" for (n, k), nm in best.items()) or "defaults"


# The 8B dummy model's quantization_config per int4 method (the same packed layout and kernels after load).
QUANT = {"awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
         "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq"}}


def quant_model_dir(method: str) -> str:
    """A new config folder: the bundled Llama-3.1-8B config with QUANT[method] as its quantization_config."""
    cfg_dir = tempfile.mkdtemp()
    config = json.load(open("pagedllm/model_configs/llama3-8b/config.json"))
    config["quantization_config"] = QUANT[method]
    json.dump(config, open(os.path.join(cfg_dir, "config.json"), "w"))
    return cfg_dir


def w1_runs(runs: dict[str, dict[str, str]], seconds_left: Callable[[], float], timeout: float) -> None:
    """`pagedllm bench throughput` W1 of the 8B AWQ dummy model once per run (name -> environment), each in its
    own process, back to back, recorded; a run not started with < 60 s left, each capped at `timeout`."""
    cfg_dir = quant_model_dir("awq")
    for name, extra in runs.items():
        left = seconds_left()
        if left < 60:
            print(f"(budget: W1 {name} not run)", flush=True)
            continue
        try:
            r, proc, seconds = bench_w1(cfg_dir, min(timeout, left - 10), extra, ("--skip-tokenizer-init",))
        except subprocess.TimeoutExpired:
            record(f"W1 8B AWQ, {name}", "timed out")
            continue
        record(f"W1 8B AWQ, {name}", f"failed (rc {proc.returncode})" if r is None else
               f"{r['output_tokens_per_second']:.1f} output tok/s ({seconds:.0f} s with start)")


def batch1_steps(method: str, warm_tokens: int = 257, iters: int = 3, in_process: bool = True):
    """(llm, decode step seconds) of the Llama-3.1-8B dummy model quantized by `method` (QUANT), batch 1,
    max_num_seqs 1 (one captured decode graph), the engine in this process where `in_process` (so that
    use_best_configs' routing reaches it), else in its own as by default: one warm-up batch of
    `warm_tokens` outputs, then `iters` batches of 128 in / 257 out timed as `bench latency` times decode
    steps. The timing loop of this script, gpu_wna16_packed.py and gpu_wna16_final.py."""
    from pagedllm.benchmarks.datasets import random_requests
    from pagedllm.benchmarks.latency import time_batch
    from pagedllm.entrypoints.llm import LLM

    if in_process:
        os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    cfg_dir = quant_model_dir(method)
    t0 = time.monotonic()
    llm = LLM(cfg_dir, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, max_num_seqs=1)
    print(f"[8B {method.upper()} ready in {time.monotonic() - t0:.0f} s]", flush=True)

    def prompts(i: int) -> list[list[int]]:
        return [r.prompt_token_ids for r in random_requests(1, (128, 128), (257, 257), 10000, i)]

    time_batch(llm, prompts(0), warm_tokens, 1.0, "warm")
    steps = []
    for i in range(iters):
        steps += time_batch(llm, prompts(1 + i), 257, 1.0, f"it{i}").decode_steps
        print(f"  {method} iteration {i}: mean decode step {statistics.fmean(steps) * 1e3:.3f} ms so far", flush=True)
    return llm, steps


def step() -> None:
    from pagedllm.benchmarks.datasets import random_requests
    from pagedllm.benchmarks.latency import time_batch

    table = use_best_configs()
    print(f"one-row int4 linears in the step: {table}", flush=True)
    llm, steps = batch1_steps("awq")
    mean = statistics.fmean(steps)
    record(f"batch-1 decode step, 8B AWQ g128 (128 in / 257 out, 3 iters; {table})",
           f"mean {mean * 1e3:.3f} ms, p50 {statistics.median(steps) * 1e3:.3f} ms (before: 3.302; target 2.2)")
    if time.monotonic() - T0 > 100:
        print("(no time left for the profiled batch)", flush=True)
        return
    from torch.profiler import ProfilerActivity, profile

    prompt = [r.prompt_token_ids for r in random_requests(1, (128, 128), (257, 257), 10000, 9)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time_batch(llm, prompt, 33, 1.0, "prof")
    n_dec = len(t.decode_steps)
    rows = []
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if us > 0:
            rows.append((us, ev.count, ev.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    wall = sum(t.decode_steps) + sum(t.prefill_steps)
    print(f"\nprofiled batch (1 prefill + {n_dec} decode steps, wall {wall * 1e3:.1f} ms): kernel time {total / 1e3:.1f} ms")
    print("| kernel | us per decode step (all steps / decode steps) | calls |\n|---|---|---|")
    for us, cnt, key in rows[:18]:
        print(f"| {key[:90]} | {us / max(1, n_dec):.1f} | {cnt} |")
    record("profiled: kernel time per step (incl. the prefill's share) / wall step",
           f"{total / max(1, n_dec) / 1e3:.3f} ms / {statistics.fmean(t.decode_steps) * 1e3:.3f} ms")


if __name__ == "__main__":
    run_sections({"compile": precompile, "check": check, "time": time_kernels, "step": step})
