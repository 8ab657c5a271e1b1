"""Sweep the tile GEMM (`pagedllm/kernels/matmul.py`) against cuBLAS on the decode batch sizes.

Usage (GPU machine): python3 scripts/gemm_bench.py [--ms 16 32 ...] [--json OUT]
For every linear of the Qwen3-0.6B and Llama-3.1-8B shapes and every batch size M, times F.linear
(cuBLAS) and each tile config (checked against cuBLAS's output first) with CUDA events, and prints
the winner per (shape, M), the model's GEMM time per decode step both ways, and the `_TUNED` table
(a config where the tile GEMM wins by more than 3%, None where cuBLAS keeps it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm.benchmarks.roofline import _cuda_timed
from pagedllm.kernels import matmul
from pagedllm.kernels.matmul import MatmulConfig, tile_linear

REPO = Path(__file__).resolve().parent.parent
WIN = 0.97  # the tile GEMM must be at least 3% faster to take a shape


def linear_shapes(preset: str) -> list[tuple[str, int, int, int]]:
    """(name, n, k, count per step) of one decoder's linears and its LM head."""
    c = json.loads((REPO / "pagedllm/model_configs" / preset / "config.json").read_text())
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    return [
        ("qkv", q + 2 * kv, h, layers),
        ("o", h, q, layers),
        ("gate_up", 2 * c["intermediate_size"], h, layers),
        ("down", h, c["intermediate_size"], layers),
        ("lm_head", c["vocab_size"], h, 1),
    ]


def candidates(m: int) -> list[MatmulConfig]:
    out = []
    for bm, bn, bk, st, split in itertools.product([64, 128], [64, 128, 256], [64, 128], [3, 4], [1, 2, 4]):
        if bm == 128 and m <= 64:
            continue
        if (bm + bn) * bk * 2 * st > 200 * 1024:  # shared memory of the pipeline stages
            continue
        out.append(MatmulConfig(bm, bn, bk, split, 4 if bm * bn <= 64 * 128 else 8, st))
    return out


def sweep(ms: list[int]) -> tuple[dict, list]:
    tuned: dict[tuple[int, int], list] = {}
    rows = []
    seen = set()
    for preset in ("qwen3-0.6b", "llama3-8b"):
        for name, n, k, count in linear_shapes(preset):
            if (n, k) in seen:
                continue
            seen.add((n, k))
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            entries = []
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, w)
                cublas = _cuda_timed(functools.partial(F.linear, x, w), 20)
                best = (float("inf"), None)
                for cfg in candidates(m):
                    try:
                        out = tile_linear(x, w, config=cfg)
                        err = (out.float() - ref.float()).abs().max().item()
                        if err > 0.05:
                            print(f"  {preset} {name} m={m} {cfg}: wrong (max err {err:.3g})")
                            continue
                        t = _cuda_timed(functools.partial(tile_linear, x, w, config=cfg), 20)
                    except Exception as e:  # out of resources
                        print(f"  {preset} {name} m={m} {tuple(cfg)}: {type(e).__name__}")
                        continue
                    if t < best[0]:
                        best = (t, cfg)
                t, cfg = best
                flops = 2 * m * n * k
                win = t < WIN * cublas
                entries.append((m, cfg if win else None))
                rows.append((preset, name, n, k, count, m, cublas, t, cfg))
                print(f"{preset} {name} ({n}x{k}) m={m}: cuBLAS {cublas * 1e6:.1f} us ({flops / cublas / 1e12:.0f} TF), "
                      f"tile {t * 1e6:.1f} us ({flops / t / 1e12:.0f} TF) {tuple(cfg) if cfg else ''}"
                      f"{'  <- tile' if win else ''}", flush=True)
            # Merge neighbouring batch sizes with the same choice: [(max_m, cfg)], ascending.
            merged: list[tuple[int, MatmulConfig | None]] = []
            for m, cfg in entries:
                if merged and merged[-1][1] == cfg:
                    merged[-1] = (m, cfg)
                else:
                    merged.append((m, cfg))
            if any(cfg is not None for _, cfg in merged):
                tuned[(n, k)] = merged
    return tuned, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", type=int, nargs="*", default=[16, 32, 64, 96, 128, 160, 192, 224, 256])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    tuned, rows = sweep(args.ms)
    print(f"\nsweep took {time.time() - t0:.0f} s")
    print("| model | M | cuBLAS GEMMs per step | with tile GEMM where it wins |\n|---|---|---|---|")
    for preset in ("qwen3-0.6b", "llama3-8b"):
        names = {(n, k): c for _, n, k, c in linear_shapes(preset)}
        for m in args.ms:
            sel = [r for r in rows if r[5] == m and (r[2], r[3]) in names]
            base = sum(r[6] * names[(r[2], r[3])] for r in sel)
            new = sum(min(r[6], r[7] if r[7] < WIN * r[6] else r[6]) * names[(r[2], r[3])] for r in sel)
            print(f"| {preset} | {m} | {base * 1e3:.3f} ms | {new * 1e3:.3f} ms |")
    print("\n_TUNED = {")
    for (n, k), entries in tuned.items():
        print(f"    ({n}, {k}): [" + ", ".join(
            f"({m}, {'None' if c is None else 'MatmulConfig' + str(tuple(c))})" for m, c in entries) + "],")
    print("}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {f"{n},{k}": [[m, list(c) if c else None] for m, c in e] for (n, k), e in tuned.items()}))
    matmul._TUNED = tuned  # for a caller that imports this module and runs the engine next


if __name__ == "__main__":
    main()
