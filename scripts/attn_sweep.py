"""Sweep the paged-attention kernel's tile configuration on the GPU for W1-like batches.

Usage (GPU machine): python3 scripts/attn_sweep.py [--kv-dtype fp8] [--cases decode256,decode64]
For each case (a decode batch, a prefill-heavy mixed batch) and head layout (Qwen3-0.6B 16/8,
Llama-3.1-8B 32/8, head_dim 128, bf16, block_size 16), every (BLOCK_M, TILE_N, num_warps,
num_stages) candidate is checked against the default config's output and timed with CUDA
events; the K/V bytes read give the bandwidth. Prints the best per case and a table.
`--kv-dtype fp8`: the cache in float8_e4m3fn (`kv_cache_dtype="fp8"`), half the bytes per key; the
default config is the one bf16 tuned, so the sweep shows whether fp8 wants other tiles.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import random
import time

import torch
import triton

from pagedllm.attention.metadata import build_metadata
from pagedllm.benchmarks.roofline import _cuda_timed
from pagedllm.kernels import paged_attention as pa


def case(kind: str, heads: int, kv_heads: int, seed: int = 0, kv_dtype: torch.dtype = torch.bfloat16):
    rng = random.Random(seed)
    bs, d = 16, 128
    if kind == "decode256":
        q_lens = [1] * 256
        seq = [rng.randint(600, 1000) for _ in q_lens]
    elif kind == "decode64":
        q_lens = [1] * 64
        seq = [rng.randint(900, 1500) for _ in q_lens]
    else:  # W1's first steps: ~14 prompts of 100-1024 tokens filling an 8192-token budget + decodes
        q_lens, seq = [], []
        left = 8192 - 40
        while left > 0:
            n = min(rng.randint(100, 1024), left)
            q_lens.append(n)
            seq.append(n)
            left -= n
        q_lens += [1] * 40
        seq += [rng.randint(100, 1024) for _ in range(40)]
    blocks_needed = sum(-(-s // bs) for s in seq)
    perm = torch.randperm(blocks_needed).tolist()
    tables, at = [], 0
    for s in seq:
        nb = -(-s // bs)
        tables.append(perm[at: at + nb])
        at += nb
    md = build_metadata(q_lens, seq, tables, bs, device="cuda")
    cache = torch.randn(2, blocks_needed, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    q = torch.randn(sum(q_lens), heads, d, device="cuda", dtype=torch.bfloat16)
    kv_bytes = sum(seq) * kv_heads * d * 2 * cache.element_size()
    return q, cache, md, kv_bytes


def timed(fn) -> float:
    """Microseconds per call: roofline's CUDA-event timer, 20 calls after one warm-up."""
    return _cuda_timed(fn, 20) * 1e6


def _fixed(cfg: tuple, *_args, **_kwargs) -> tuple:
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-dtype", choices=["bf16", "fp8"], default="bf16")
    ap.add_argument("--cases", default="decode256,decode64,mixed8192")
    ap.add_argument("--quick", action="store_true", help="decode: 128/256-key tiles, 4/8 warps, 2/3 stages only")
    args = ap.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "fp8" else torch.bfloat16
    default = pa._tile_config
    rows = []
    t0 = time.time()
    for kind in args.cases.split(","):
        decode = kind.startswith("decode")
        for heads, kvh in ((16, 8), (32, 8)):
            q, cache, md, kv_bytes = case(kind, heads, kvh, kv_dtype=kv_dtype)
            ref = pa.paged_attention(q, cache, md, 0.088)
            run = functools.partial(pa.paged_attention, q, cache, md, 0.088)
            base_us = timed(run)
            group = heads // kvh
            cands = (itertools.product([16], [128, 256] if args.quick else [64, 128, 256], [4, 8],
                                       [2, 3] if args.quick else [2, 3, 4]) if decode
                     else itertools.product([64, 128], [32, 64], [4, 8], [2, 3]))
            best = (base_us, "default")
            for bm, tn, w, st in cands:
                if bm < group:
                    continue
                pa._tile_config = functools.partial(_fixed, (bm, max(1, bm // group), tn, w, st))
                try:
                    out = pa.paged_attention(q, cache, md, 0.088)
                    err = (out.float() - ref.float()).abs().max().item()
                    us = timed(run)
                except Exception as e:  # out of shared memory etc.
                    print(f"{kind} {heads}/{kvh} bm{bm} tn{tn} w{w} s{st}: failed {type(e).__name__}")
                    continue
                finally:
                    pa._tile_config = default
                cfg = f"bm{bm} tn{tn} w{w} s{st}"
                print(f"{kind} {heads}/{kvh} {cfg}: {us:8.1f} us  {kv_bytes / us / 1e6:6.2f} TB/s  err {err:.3g}")
                if err < 0.02 and us < best[0]:
                    best = (us, cfg)
            rows.append((kind, f"{heads}/{kvh}", base_us, kv_bytes / base_us / 1e6, best[1], best[0]))
    print(f"\nsweep took {time.time() - t0:.0f} s")
    print(f"KV cache {args.kv_dtype}")
    print("| case | heads | default us | default TB/s | best config | best us |\n|---|---|---|---|---|---|")
    for k, h, b, bw, cfg, us in rows:
        print(f"| {k} | {h} | {b:.1f} | {bw:.2f} | {cfg} | {us:.1f} |")
    _ = triton  # imported for its version in logs
    print("triton", triton.__version__)


if __name__ == "__main__":
    main()
