"""What the GPU check scripts share: the results table, the device copy bandwidth (the floor's
memory speed), CUDA-graph replay timing (one call, or calls rotating over weight copies), the fused MoE expert weights and their floor, and the W1
throughput run of `pagedllm bench throughput`.

Import it from a script run as `python3 scripts/NAME.py` (its folder is then on sys.path):
`from _gpu_common import record, print_results`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

RESULTS: list[tuple[str, str]] = []
# (experts, top_k, hidden, moe_intermediate) of the real MoE models (pagedllm/model_configs/NAME).
MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408)}


def record(name: str, value: str) -> None:
    RESULTS.append((name, value))
    print(f"## {name}: {value}", flush=True)


def print_results() -> None:
    """The table printed last: one row per `record`."""
    print("\n| check | result |\n|---|---|")
    for name, value in RESULTS:
        print(f"| {name} | {value} |")


def run_sections(sections: dict[str, Callable[[], None]], only: list[str] | None = None) -> bool:
    """Run each section of `only` (default: `--only NAME ...` from the command line, all in order), a
    failing one recorded as an error without stopping the rest, GPU memory freed between them; the results
    table last. True when no section raised."""
    if only is None:
        parser = argparse.ArgumentParser()
        parser.add_argument("--only", nargs="+", choices=list(sections), default=list(sections))
        only = parser.parse_args().only
    if torch.cuda.is_available():
        print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    passed = True
    for name in only:
        t0 = time.monotonic()
        try:
            sections[name]()
        except Exception:
            traceback.print_exc()
            record(name, "ERROR (traceback above)")
            passed = False
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"[{name}: {time.monotonic() - t0:.0f} s]", flush=True)
    print_results()
    return passed


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy (read + write counted), the floor's memory speed."""
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 10 * 2 * a.numel() * 2 / (time.perf_counter() - t0)
    del a, b
    return bw


def graph_time_us(fn: Callable[[], Any]) -> float:
    """Microseconds per call of `fn` replayed as a CUDA graph (3 warm-up calls, 50 replays)."""
    for _ in range(3):
        fn()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    us = (time.perf_counter() - t0) / 50 * 1e6
    del g
    return us


def offline_plain_run(args: argparse.Namespace) -> tuple[Any, list, float, Any, Any]:
    """`pagedllm bench throughput`'s offline schedule from its parsed flags (`throughput.add_cli_args`), run once
    after the warm-up: (llm, requests, temperature, device spec, that run's ThroughputResult), for scripts that
    run the same schedule again under a probe (gpu_step_profile.py, gpu_step_gaps.py)."""
    from pagedllm.benchmarks import throughput as tp
    from pagedllm.benchmarks.datasets import requests_from_args

    requests = requests_from_args(args)
    temperature = args.temperature if args.temperature is not None else tp.W1_TEMPERATURE
    dev = tp.measured_device(args)
    llm = tp.make_llm(args)
    tp.warmup(llm, args.num_warmup)
    return llm, requests, temperature, dev, tp.run_throughput(llm, requests, temperature, dev)


def rotating_graph_us(call: Callable[[int], object], copies: int, reps: int = 20) -> float:
    """Median microseconds per call of call(i), i rotating over `copies` weight copies (so each call
    reads its weights from memory, not from L2), `reps` calls captured in one CUDA graph, 5 timed
    replays. Raises where the calls cannot be captured."""
    for i in range(copies):
        call(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            call(r % copies)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    del g
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|, in float32."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-6)).item()


def shuffled_decode_metadata(s_lens: list[int], block_size: int, rng: random.Random,
                             max_seq_len: int = 4096):
    """(AttentionMetadata, blocks) of a decode batch with these context lengths on the GPU, each
    request's blocks drawn from one shuffled pool (rng), max_seq_len as the CUDA graphs capture it."""
    from pagedllm.attention.metadata import build_metadata

    blocks = [-(-s // block_size) for s in s_lens]
    perm = list(range(sum(blocks)))
    rng.shuffle(perm)
    tables, i = [], 0
    for nb in blocks:
        tables.append(perm[i:i + nb])
        i += nb
    md = build_metadata([1] * len(s_lens), s_lens, tables, block_size, device="cuda")
    md.max_seq_len = max_seq_len
    return md, sum(blocks)


def moe_expert_weights(e: int, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 experts: w13 (e, 2 * inter, hidden) and w2 (e, hidden, inter)."""
    w13 = torch.randn(e, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, hidden, inter, device="cuda", dtype=torch.bfloat16) * 0.02
    return w13, w2


def moe_floor_us(hit: int, hidden: int, inter: int, bw: float) -> float:
    """The experts hit, each read once (w1, w3, w2: 3 x hidden x inter bf16) at `bw` bytes/s."""
    return hit * 3 * hidden * inter * 2 / bw * 1e6


def bench_w1(model: str, timeout: float, extra_env: dict[str, str] | None = None,
             extra_args: tuple[str, ...] = ()) -> tuple[dict | None, subprocess.CompletedProcess, float]:
    """`pagedllm bench throughput --dataset w1` on a preset's config or a config folder (dummy weights, 4096
    context) in a fresh process, with `extra_env` set and `extra_args` added: (its JSON result or None on
    failure, the process, seconds in all)."""
    out = tempfile.mktemp(suffix=".json")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
               **(extra_env or {}))
    cmd = [sys.executable, "-m", "pagedllm", "bench", "throughput", "--model", model, "--load-format",
           "dummy", "--dataset", "w1", "--max-model-len", "4096", "--output-json", out, *extra_args]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(out):
        print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
        return None, proc, time.monotonic() - t0
    with open(out) as f:
        return json.load(f), proc, time.monotonic() - t0
