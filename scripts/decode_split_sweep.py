"""Decode attention at small and medium batches with long contexts (W1's tail), timed in CUDA graphs:
split count x tile config, Llama-3.1-8B heads (32/8, head_dim 128, bf16, block 16). The table behind
kernels/split_k.py's _NO_SPLIT_PROGRAMS. Usage (GPU machine): python3 scripts/decode_split_sweep.py"""

from __future__ import annotations

import functools
import random

import torch
from graph_timing import graph_us

from pagedllm.attention.metadata import build_metadata
from pagedllm.kernels import paged_attention as pa

ORIG = pa._tile_config


def case(n, lo, hi, seed=0, heads=32, kvh=8, bs=16, d=128):
    rng = random.Random(seed)
    seq = [rng.randint(lo, hi) for _ in range(n)]
    nblk = sum(-(-s // bs) for s in seq)
    perm = torch.randperm(nblk, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for s in seq:
        nb = -(-s // bs)
        tables.append(perm[at: at + nb])
        at += nb
    md = build_metadata([1] * n, seq, tables, bs, device="cuda")
    md.max_seq_len = 4096  # as in a captured graph
    cache = torch.randn(2, nblk, bs, kvh, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(n, heads, d, device="cuda", dtype=torch.bfloat16)
    return q, cache, md, sum(seq) * kvh * d * 4


def main():
    rows = []
    tiles = [(128, 4, 3), (128, 4, 2), (64, 4, 2), (64, 4, 3), (32, 4, 3), (32, 4, 2), (64, 8, 3), (128, 8, 2)]
    for n, lo, hi in [(1, 1500, 1500), (1, 300, 300), (4, 1000, 2000), (16, 1000, 2000), (32, 1000, 2000),
                      (64, 800, 1800), (128, 600, 1600), (256, 100, 1100)]:
        q, cache, md, kvb = case(n, lo, hi)
        attend = functools.partial(pa.paged_attention, q, cache, md, 0.088)
        ref = attend().float()
        default_splits = pa.choose_num_splits(n, 8, 1, 4096)
        t = graph_us([attend] * 10)
        res = [(t, f"default (splits {default_splits}, tile 128/w4/s3)")]
        for splits in (1, 2, 4, 8, 16, 32):
            if n * 8 * splits > 8192:
                continue
            for tn, w, st in tiles:
                pa._tile_config = lambda qpk, hdp, dec, few_programs=False, tn=tn, w=w, st=st: (
                    (16, 4, tn, w, st) if dec else ORIG(qpk, hdp, dec))
                try:
                    fn = functools.partial(attend, num_splits=splits)
                    err = (fn().float() - ref).abs().max().item()
                    t = graph_us([fn] * 10)
                    res.append((t, f"splits {splits} tile {tn}/w{w}/s{st} err {err:.3f}"))
                except Exception as e:  # noqa: BLE001
                    res.append((1e9, f"splits {splits} tile {tn}/w{w}/s{st} FAILED {e!s:.60}"))
                finally:
                    pa._tile_config = ORIG
        base = res[0][0]
        for t, desc in [res[0]] + sorted(res[1:])[:6]:
            rows.append((f"b{n} ctx[{lo},{hi}]", desc, t, kvb / t / 1e6, base / t))
    print("\n| batch | variant | us | TB/s | speed-up |\n|---|---|---|---|---|")
    for a, b, t, bw, sp in rows:
        print(f"| {a} | {b} | {t:.1f} | {bw:.2f} | {sp:.2f}x |")


if __name__ == "__main__":
    main()
