"""Issue 19's FP8 W1 bars on one H200: where an fp8 W1 step's device time goes, each part against its floor,
and the candidate decode-attention kernels for an fp8 KV cache timed against the current one.

    python3 scripts/gpu_fp8_w1_probe.py [--sections attn,stream,profile] [--budget 95]

Sections (in order; each stops starting new work when the wall budget is spent):
  attn     Llama-3.1-8B heads (32 / 8, head_dim 128), W1-like decode batches (scripts/attn_sweep.case:
           256 requests x 600-1000 keys, 64 x 900-1500), shuffled blocks of 16: the fused decode kernel
           (`decode_attention_fused`, what the CUDA graphs run) for a bf16 and an fp8 (e4m3) cache, each
           DECODE_VARIANTS loop and a few (BLOCK_M, TILE_N, warps, stages), timed in CUDA graphs; error vs the
           fp32 reference (q, K, V as the kernel sees them, in fp32); bandwidth of the K / V bytes.
  stream   the same batches' K / V bytes read with the decode kernel's addressing by a kernel that only
           sums them (no softmax, no dots): the access pattern's own bandwidth, bf16 and fp8, one or two
           kv heads a program (fp8 rows of one head are 128-byte pieces 1 KB apart).
  quant    the activation quantizer after RMSNorm / SiLU-and-mul (two launches) vs the fused kernels
           (kernels/quant_act.rms_norm_quant, silu_and_mul_quant) at W1's row counts, CUDA graphs.
  gemm     the four Llama-3.1-8B fp8 linears through w8a8_linear at decode row counts (the dispatch's path,
           and the Triton W8A8 GEMM forced), rotating over weight copies, against the byte floor (weights
           at 4.2 TB/s) and the FLOP floor (1,600 TFLOP/s fp8).
  profile  W1 with quantization="fp8" (`bench throughput`'s schedule, dummy weights), once under
           torch.profiler (CUDA activity only; the run before it warms the kernels): kernels grouped
           by family, and split into steps (a step ends with its sampling kernels) of two kinds, decode
           steps and steps carrying prefill chunks, with each kind's device time, wall span and count.
Prints tables last.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import random
import sys
import time
from collections import defaultdict

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

T0 = time.monotonic()
PROFILE_S = 52.0
ROWS: list[str] = []


def left(budget: float) -> float:
    return budget - (time.monotonic() - T0)


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:5.1f} s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- batches
def decode_case(kind: str, kv_dtype: torch.dtype, seed: int = 0):
    """(qkv, positions, cos_sin, cache, md, kv_bytes) of a W1-like decode batch, Llama-3.1-8B heads."""
    from attn_sweep import case

    from pagedllm.kernels.rotary import build_cos_sin_cache

    q, cache16, md, kv_bytes16 = case(kind, 32, 8, seed=seed)
    n = q.shape[0]
    qkv = torch.randn(n, 48 * 128, device="cuda", dtype=torch.bfloat16)
    positions = (md.seq_lens[:n] - 1).to(torch.int64)
    cache = cache16.to(kv_dtype)
    return qkv, positions, build_cos_sin_cache(128, 4096).cuda(), cache, md, kv_bytes16 * cache.element_size() // 2


def attn_ref(qkv, positions, cos_sin, cache, md) -> torch.Tensor:
    """The fused kernel's fp32 reference: prep + attention with q, the cache and the new K / V in fp32
    (the cache's fp8 values exactly; the new key rounded to the cache dtype first, as the kernel does)."""
    from pagedllm.kernels.decode_attention import decode_attention_fused_ref

    work = cache.clone()
    decode_attention_fused_ref(qkv, positions, cos_sin, work, md, 0.088, 32, 8, 128)  # writes the new K / V
    return decode_attention_fused_ref(qkv.float(), positions, cos_sin.float(), work.float(), md, 0.088, 32, 8, 128)


def graph_us(fn, reps: int = 20) -> float:
    from _gpu_common import rotating_graph_us

    return rotating_graph_us(lambda i: fn(), 1, reps)


# ---------------------------------------------------------------------------------------------- attn
ATTN_CONFIGS = {  # cache -> [(variant, config or None = the default tiles)], in the order timed
    "bf16": [(0, None), (3, (16, 64, 4, 3))],
    "fp8": [(0, None), (3, (16, 128, 4, 3)), (3, (16, 64, 4, 3)), (3, (16, 128, 8, 3)), (3, (16, 64, 4, 4)),
            (3, (16, 128, 4, 2)), (0, (16, 128, 8, 2))],
}
CASES = ["decode256", "decode64"]
STREAM_CONFIGS = ((1, 128, 4, 3), (8, 16, 4, 3), (2, 64, 4, 3), (1, 64, 4, 3))


def section_attn(budget: float) -> None:
    """CASES[0] with every config of ATTN_CONFIGS; later cases with the current kernel and the fastest fp8
    variant-2 config of the first case (the kernels are compiled by then)."""
    from _gpu_common import rel_err

    from pagedllm.kernels.decode_attention import decode_attention_fused

    best: dict[tuple[str, int], tuple[float, tuple | None]] = {}
    for ci, kind in enumerate(CASES):
        for cname, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            if left(budget) < 2:
                log("attn: budget spent")
                return
            qkv, pos, cs, cache, md, kv_bytes = decode_case(kind, dt)
            ref = attn_ref(qkv, pos, cs, cache, md)
            configs = ATTN_CONFIGS[cname] if ci == 0 else [(0, None)] + [
                (v, best[(cname, v)][1]) for v in (2,) if (cname, v) in best]
            for variant, cfg in configs:
                if left(budget) < 2:
                    log("attn: budget spent")
                    return
                tag = f"{kind} {cname} v{variant} {cfg or 'default'}"
                try:
                    work = cache.clone()
                    out = decode_attention_fused(qkv, pos, cs, work, md, 0.088, 32, 8, 128, variant=variant,
                                                 config=cfg)
                    err = rel_err(out, ref)
                    us = graph_us(functools.partial(decode_attention_fused, qkv, pos, cs, work, md, 0.088, 32, 8,
                                                    128, variant=variant, config=cfg))
                    row = f"| {tag} | {us:.1f} | {kv_bytes / us / 1e6:.2f} | {err:.2e} |"
                    if ci == 0 and ((cname, variant) not in best or us < best[(cname, variant)][0]):
                        best[(cname, variant)] = (us, cfg)
                except Exception as e:  # noqa: BLE001 - a config over the shared memory etc.
                    row = f"| {tag} | ERR {type(e).__name__}: {str(e)[:80]} | | |"
                ROWS.append(row)
                log(row)
            del cache, ref
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- stream
@triton.jit
def _stream_kernel(out_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, stride_blk, stride_slot, stride_h, stride_bt,
                   HEADS: tl.constexpr, TILE_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # One program per (request, group of HEADS kv heads): read its K and V rows tile by tile, as the
    # decode kernel addresses them, and sum them (so the loads cannot be dropped).
    r = tl.program_id(0)
    g = tl.program_id(1)
    n_keys = tl.load(seq_lens_ptr + r)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, HEADS * D)  # HEADS adjacent heads: one contiguous HEADS * D row piece
    acc = tl.zeros([TILE_N, HEADS * D], tl.float32)
    for start in range(0, n_keys, TILE_N):
        pos = start + offs_n
        ok = pos < n_keys
        blk = tl.load(bt_ptr + r.to(tl.int64) * stride_bt + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = blk * stride_blk + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot + g * HEADS * stride_h
        ptrs = off[:, None] + offs_d[None, :]
        acc += tl.load(k_ptr + ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + r * (tl.num_programs(1)) + g, tl.sum(tl.sum(acc, 1), 0))


def stream_kv(out, k, v, md, heads: int, tile: int, warps: int, stages: int) -> None:
    _stream_kernel[(md.num_reqs, 8 // heads)](
        out, k, v, md.block_table, md.seq_lens, k.stride(0), k.stride(1), k.stride(2), md.block_table.stride(0),
        HEADS=heads, TILE_N=tile, D=128, BLOCK_SIZE=16, num_warps=warps, num_stages=stages)


def section_stream(budget: float) -> None:
    for kind in CASES:
        for cname, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            _, _, _, cache, md, kv_bytes = decode_case(kind, dt)
            k, v = cache[0], cache[1]
            n = md.num_reqs
            for heads, tile, warps, stages in STREAM_CONFIGS[:1] if cname == "bf16" else STREAM_CONFIGS:
                if left(budget) < 1:
                    log("stream: budget spent")
                    return
                out = torch.empty(n * (8 // heads), device="cuda")
                try:
                    us = graph_us(functools.partial(stream_kv, out, k, v, md, heads, tile, warps, stages))
                    row = f"| stream {kind} {cname} {heads} head(s)/program, {tile} keys, w{warps} s{stages} | {us:.1f} | {kv_bytes / us / 1e6:.2f} | |"
                except Exception as e:  # noqa: BLE001
                    row = f"| stream {kind} {cname} {heads}h {tile} | ERR {type(e).__name__}: {str(e)[:80]} | | |"
                ROWS.append(row)
                log(row)
            del cache
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- quant
def section_quant(budget: float) -> None:
    from pagedllm.kernels.activation import silu_and_mul
    from pagedllm.kernels.quant_act import quantize_activation_triton, rms_norm_quant, silu_and_mul_quant
    from pagedllm.kernels.rmsnorm import rms_norm

    fp8 = torch.float8_e4m3fn
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for m in (256, 8192, 64):
        if left(budget) < 1:
            return
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        g = torch.randn(m, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        pair = graph_us(lambda x=x, r=r: quantize_activation_triton(rms_norm(x, w, 1e-5, r)[0], fp8))
        fused = graph_us(lambda x=x, r=r: rms_norm_quant(x, w, 1e-5, fp8, r))
        apair = graph_us(lambda g=g: quantize_activation_triton(silu_and_mul(g), fp8))
        afused = graph_us(lambda g=g: silu_and_mul_quant(g, fp8))
        row = (f"| quant M={m}: rmsnorm+quant {pair:.1f} -> fused {fused:.1f}; silu_and_mul+quant {apair:.1f} -> "
               f"fused {afused:.1f} | {pair + apair - fused - afused:.1f} saved | | |")
        ROWS.append(row)
        log(row)


# ---------------------------------------------------------------------------------------------- gemm
GEMM_MS = (128, 256, 64, 192, 32)
LINEARS = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
# Triton tiles timed on the narrow linears (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA), each with
# K unsplit and in 2 / 4 / 8 slices (slices of >= 4 BLOCK_K steps), the slices summed in the same launch
# (W8A8Config.SERIAL); "split2l" = the two-launch sum (PAGEDLLM_W8A8_SPLIT_K=1's kernel) at its own config.
GEMM_TILES = {"64x128": (64, 128, 128, 8, 4, 4, False), "64x128 tma": (64, 128, 128, 8, 4, 4, True),
              "128x128": (128, 128, 128, 8, 8, 3, False), "128x128 tma": (128, 128, 128, 8, 8, 3, True),
              "64x64x256": (64, 64, 256, 8, 4, 3, False), "128x64": (128, 64, 128, 8, 4, 4, False)}
GEMM_SPLITS = (1, 2, 4, 8)


def gemm_tile_jobs(m: int, n: int, k: int) -> list[tuple[str, tuple]]:
    """(tag, W8A8Config fields) of the Triton variants timed at (m, n, k): every tile of GEMM_TILES with
    the splits whose slices keep >= 4 BLOCK_K steps and whose programs x splits stay <= 4 waves of 132."""
    jobs = []
    for tag, (bm, bn, bk, g, w, st, tma) in GEMM_TILES.items():
        tiles = -(-m // bm) * -(-n // bn)
        for split in GEMM_SPLITS:
            if split > 1 and (k // (split * bk) < 4 or tiles * split > 4 * 132):
                continue
            jobs.append((f"{tag} k/{split}", (bm, bn, bk, g, w, st, tma, split, split > 1)))
    return jobs


def _warm_gemm(fields: tuple) -> str:
    """A worker: compile one Triton W8A8 variant (as the timing calls it: 128 fp8 rows, K 4096, bf16 out)."""
    from pagedllm.kernels.w8a8_gemm import W8A8Config, ensure_workspace, w8a8_gemm

    t = time.monotonic()
    fp8 = torch.float8_e4m3fn
    ensure_workspace(torch.device("cuda"))
    try:
        x = torch.zeros(128, 4096, device="cuda").to(fp8)
        w8a8_gemm(x, torch.zeros(4096, 4096, device="cuda").to(fp8), torch.ones(128, 1, device="cuda"),
                  torch.ones(4096, device="cuda"), None, torch.bfloat16, config=W8A8Config(*fields))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported; the timing then reports it again
        return f"{fields} FAILED {type(e).__name__}: {str(e)[:120]}"
    return f"{fields[:3]} split {fields[7]} {time.monotonic() - t:.1f}s"


def precompile_gemm() -> None:
    """Compile every Triton variant of section_gemm in worker processes at once (Triton's disk cache
    then serves the timing process): one compile per tile unsplit, one split (the split count is a
    runtime value), and the two-launch split-K kernel."""
    import multiprocessing as mp

    jobs = []
    for bm, bn, bk, g, w, st, tma in GEMM_TILES.values():
        jobs += [(bm, bn, bk, g, w, st, tma, 1, False), (bm, bn, bk, g, w, st, tma, 2, True)]
    jobs.append((64, 128, 128, 8, 4, 4, False, 2, False))
    t = time.monotonic()
    with mp.get_context("spawn").Pool(min(len(jobs), max(1, (os.cpu_count() or 4) - 2))) as pool:
        done = pool.map(_warm_gemm, jobs, chunksize=1)
    log(f"gemm: precompiled {len(done)} variants in {time.monotonic() - t:.1f} s: " + "; ".join(done))


def section_gemm(budget: float) -> None:
    """The fp8 decode GEMMs without the activation quantizer (the fused RMSNorm / SiLU kernels hand them
    quantized rows): cuBLAS row-wise `_scaled_mm` (the dispatch above 64 rows), cuBLASLt with per-tensor
    scales (what vLLM's online fp8 runs; the scales here are not the per-token ones, so only its speed
    counts), and the Triton W8A8 GEMM at each tile / split; the best per (linear, M) last."""
    from _gpu_common import rel_err, rotating_graph_us

    from pagedllm.kernels.scaled_mm import _fp8_cuda, choose_path, quantize_activation, scaled_mm_ref
    from pagedllm.kernels.w8a8_gemm import W8A8Config, ensure_workspace, w8a8_gemm, w8a8_gemm_config

    precompile_gemm()
    fp8 = torch.float8_e4m3fn
    ensure_workspace(torch.device("cuda"))
    one = torch.ones((), device="cuda")
    weights = {}
    for name, (n, k) in LINEARS.items():
        copies = max(1, -(-160_000_000 // (n * k)))  # >= 160 MB of copies: L2 cannot serve a repeat
        weights[name] = [((torch.randn(n, k, device="cuda") * 0.05).to(fp8), torch.rand(n, device="cuda") * 1e-3)
                         for _ in range(copies)]
    best_rows = []
    for m in GEMM_MS:
        layer = defaultdict(float)
        for name, (n, k) in LINEARS.items():
            if left(budget) < 2:
                log("gemm: budget spent")
                ROWS.extend(best_rows)
                return
            ws = weights[name]
            xq, xs = quantize_activation(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), fp8)
            ref = scaled_mm_ref(xq, ws[0][0], xs, ws[0][1], None, torch.bfloat16)
            fb, ff = (n * k + m * k + m * n * 2) / 4.2e12 * 1e6, 2 * m * n * k / 1.6e15 * 1e6
            times = {"cublas": rotating_graph_us(
                lambda i, xq=xq, xs=xs, ws=ws, m=m: _fp8_cuda(xq, xs, ws[i][0], ws[i][1], None, m, torch.bfloat16),
                len(ws))}
            times["cublasLt per-tensor"] = rotating_graph_us(
                lambda i, xq=xq, ws=ws: torch._scaled_mm(xq, ws[i][0].t(), scale_a=one, scale_b=one,
                                                        out_dtype=torch.bfloat16, use_fast_accum=True), len(ws))
            auto_cfg = w8a8_gemm_config(m, n, k)
            times["triton auto"] = rotating_graph_us(
                lambda i, xq=xq, xs=xs, ws=ws, c=auto_cfg: w8a8_gemm(xq, ws[i][0], xs, ws[i][1], None, torch.bfloat16,
                                                                   config=c), len(ws))
            errs = {}
            h43 = w8a8_gemm_config(m, n, k, True)
            if name != "gate_up" and h43.SPLIT_K > 1:
                times[f"split2l {h43.BLOCK_M}x{h43.BLOCK_N} k/{h43.SPLIT_K}"] = rotating_graph_us(
                    lambda i, xq=xq, xs=xs, ws=ws, c=h43: w8a8_gemm(xq, ws[i][0], xs, ws[i][1], None,
                                                                  torch.bfloat16, config=c), len(ws))
            for tag, fields in gemm_tile_jobs(m, n, k):  # gate_up: its many tiles leave only small splits
                if left(budget) < 2:
                    break
                cfg = W8A8Config(*fields)
                try:
                    errs[tag] = rel_err(w8a8_gemm(xq, ws[0][0], xs, ws[0][1], None, torch.bfloat16, config=cfg), ref)
                    times[tag] = rotating_graph_us(
                        lambda i, xq=xq, xs=xs, ws=ws, c=cfg: w8a8_gemm(xq, ws[i][0], xs, ws[i][1], None,
                                                                      torch.bfloat16, config=c), len(ws))
                except Exception as e:  # noqa: BLE001 - a tile over the shared memory etc.
                    log(f"gemm {name} M={m} {tag}: {type(e).__name__} {str(e)[:100]}")
            floor = max(fb, ff)
            cells = ", ".join(f"{t} {u:.1f}" for t, u in times.items())
            worst = max(errs.values()) if errs else float("nan")
            row = (f"| gemm {name} M={m} (dispatch: {choose_path(m, n, k, fp8)}) | {cells} | floor {floor:.1f} "
                   f"(bytes {fb:.1f}, flops {ff:.1f}) | max err {worst:.1e} |")
            ROWS.append(row)
            log(row)
            tri = {t: u for t, u in times.items() if not t.startswith("cublas")}
            bt = min(tri, key=tri.get)
            best_rows.append(f"| best {name} M={m} | triton {bt} {tri[bt]:.1f} vs cublas {times['cublas']:.1f} "
                             f"({times['cublas'] / tri[bt]:.2f}x) | floor {floor:.1f} | |")
            layer["cublas"] += times["cublas"]
            layer["best"] += min(times["cublas"], tri[bt])
            layer["floor"] += floor
        best_rows.append(f"| best layer M={m} | cublas {layer['cublas']:.1f}, best of all {layer['best']:.1f} | "
                         f"floor {layer['floor']:.1f} | |")
        log(best_rows[-1])
    ROWS.extend(best_rows)
    del weights
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- profile
KERNEL_FAMILIES = (  # (family, name substrings), the first match wins; then gpu_step_profile.family
    ("decode attention", ("_decode_fused_kernel", "_merge_splits")),
    ("prefill attention", ("_paged_attention_kernel",)),
    ("qkv prep / cache write", ("_qkv_prep", "_write_kv_cache", "rotary")),
    ("activation quant", ("_quant_row_kernel", "_scale_epilogue")),
    ("gemm triton w8a8 / w8a16", ("_w8a8", "_w8a16", "_skinny", "_scaled_gemm")),
    ("silu_and_mul", ("silu",)),
)


def family(name: str) -> str:
    import gpu_step_profile

    for fam, keys in KERNEL_FAMILIES:
        if any(k in name for k in keys):
            return fam
    return gpu_step_profile.family(name)


def section_profile(budget: float, kv_fp8: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from pagedllm.benchmarks import throughput as tp
    from pagedllm.benchmarks.datasets import requests_from_args

    parser = argparse.ArgumentParser()
    tp.add_cli_args(parser)
    argv = ["--model", "llama3-8b", "--load-format", "dummy", "--skip-tokenizer-init", "--dataset", "w1",
            "--max-model-len", "4096", "--quantization", "fp8", "--hbm-bandwidth", "4.2e12", "--peak-flops", "1.6e15"]
    if kv_fp8:
        argv += ["--kv-cache-dtype", "fp8"]
    args = parser.parse_args(argv)
    requests = requests_from_args(args)
    dev = tp.measured_device(args)
    t = time.monotonic()
    llm = tp.make_llm(args)
    tp.warmup(llm, args.num_warmup)
    log(f"profile: engine ready in {time.monotonic() - t:.1f} s")
    if left(budget) < 30:
        log("profile: budget spent before the run")
        return
    # A short warm run (W1's first 32 prompts, 4 tokens each) so kernels of prefill-sized steps are
    # compiled before profiling.
    tp.run_throughput(llm, [dataclasses.replace(r, expected_output_len=4) for r in requests[:32]],
                      tp.W1_TEMPERATURE, dev)
    llm.reset_prefix_cache()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        res = tp.run_throughput(llm, requests, tp.W1_TEMPERATURE, dev)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    log(f"profile: W1 fp8{' + fp8 KV' if kv_fp8 else ''} under the profiler {res.output_tokens_per_second:.0f} "
        f"tok/s ({wall:.2f} s); floor {res.floor_seconds:.2f} s")
    evs = [(e.start_ns(), e.duration_ns(), e.name()) for e in prof.profiler.kineto_results.events()
           if e.device_type() == torch.autograd.DeviceType.CUDA]
    evs.sort()
    log(f"profile: {len(evs)} kernels")
    # Steps: a step's kernels end with its sampling kernels; a step carries prefill when it runs the
    # unified paged-attention kernel (decode-only steps run `_decode_fused_kernel`).
    steps: list[list[tuple[int, int, str]]] = [[]]
    prev_sampling = False
    for ev in evs:
        fam = family(ev[2])
        if prev_sampling and fam != "sampling":
            steps.append([])
        steps[-1].append(ev)
        prev_sampling = fam == "sampling"
    kinds: dict[str, dict[str, float]] = {"decode": defaultdict(float), "prefill": defaultdict(float)}
    count = defaultdict(int)
    span = defaultdict(float)
    by_kernel: dict[tuple[str, str], list[int]] = defaultdict(list)
    for st in steps:
        if not st:
            continue
        kind = "prefill" if any("_paged_attention_kernel" in e[2] for e in st) else "decode"
        count[kind] += 1
        span[kind] += (st[-1][0] + st[-1][1] - st[0][0]) / 1e6  # ms
        for _, dur, name in st:
            kinds[kind][family(name)] += dur / 1e3
            by_kernel[(kind, name)].append(dur)
    tag = "fp8+fp8kv" if kv_fp8 else "fp8"
    kernel_ms = sum(sum(k.values()) for k in kinds.values()) / 1e3
    ROWS.append(f"| profile {tag}: W1 {res.output_tokens_per_second:.0f} tok/s under the profiler, wall {wall * 1e3:.0f} ms, "
                f"kernels {kernel_ms:.0f} ms ({100 * kernel_ms / (wall * 1e3):.1f}% of the wall), floor "
                f"{res.floor_seconds * 1e3:.0f} ms | | | |")
    for kind in ("decode", "prefill"):
        tot = sum(kinds[kind].values())
        ROWS.append(f"| profile {tag} {kind} steps: {count[kind]}, span {span[kind]:.0f} ms, kernels {tot / 1e3:.0f} ms "
                    f"| {tot / max(count[kind], 1):.0f} us/step | | |")
        for fam, us in sorted(kinds[kind].items(), key=lambda kv: -kv[1]):
            ROWS.append(f"| profile {tag} {kind} {fam} | {us / 1e3:.1f} ms | {100 * us / max(tot, 1):.1f}% | |")
    ranked = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:30]
    for (kind, name), durs in ranked:
        short = name if len(name) <= 80 else name[:77] + "..."
        ROWS.append(f"| top {tag} {kind} `{short}` | {sum(durs) / 1e6:.1f} ms | {len(durs)} calls | "
                    f"{sum(durs) / len(durs) / 1e3:.1f} us |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="attn,stream,quant,gemm,profile")
    ap.add_argument("--budget", type=float, default=92.0, help="wall seconds for the whole script")
    ap.add_argument("--kv-fp8", action="store_true", help="profile with kv_cache_dtype fp8 as well")
    ap.add_argument("--cases", default=",".join(CASES), help="decode batches of attn / stream")
    args = ap.parse_args()
    CASES[:] = args.cases.split(",")
    if not torch.cuda.is_available():
        print("gpu_fp8_w1_probe.py needs a CUDA device")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    random.seed(0)
    sections = args.sections.split(",")
    # Each kernel section stops starting new work at its deadline (seconds from the start, scaled to the
    # budget); the profile (~55 s: engine start, W1 under the profiler, the events) gets what is left.
    deadlines = {"attn": 22.0, "stream": 26.0, "quant": 29.0, "gemm": 38.0}
    scale = args.budget / 92.0 if "profile" in sections else args.budget / 38.0
    runners = {"attn": section_attn, "stream": section_stream, "quant": section_quant, "gemm": section_gemm}
    for name in sections:
        t = time.monotonic()
        try:
            if name in runners:
                runners[name](deadlines[name] * scale)
            elif name == "profile":
                if left(args.budget) < PROFILE_S - 5:
                    log(f"profile skipped: {left(args.budget):.0f} s left of the budget")
                    continue
                section_profile(args.budget, args.kv_fp8)
            else:
                raise ValueError(f"unknown section {name}")
        except Exception as e:  # noqa: BLE001 - report and go on
            import traceback

            traceback.print_exc()
            ROWS.append(f"| {name} | ERROR {type(e).__name__}: {str(e)[:100]} | | |")
        torch.cuda.empty_cache()
        log(f"{name} done in {time.monotonic() - t:.1f} s")
    print("\n| what | us (or ms) | TB/s (or share) | max err / max ref |\n|---|---|---|---|")
    for r in ROWS:
        print(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
