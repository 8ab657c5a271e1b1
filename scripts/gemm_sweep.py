"""cuBLAS bf16 GEMM time per (linear, rows) for the Llama-3.1-8B shapes under both BLAS libraries
(cuBLAS, cuBLASLt), weights cycled out of L2, timed inside a CUDA graph; against max(bytes / 4.24
TB/s, flops / 787 TFLOP/s). Usage (GPU machine): python3 scripts/gemm_sweep.py [ROWS ...]"""

from __future__ import annotations

import sys

import torch
from graph_timing import graph_us

BW, FL = 4.24e12, 787e12
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
ROWS = [int(x) for x in sys.argv[1:]] or [1, 8, 16, 32, 64, 96, 128, 160, 192, 224, 256, 8192]


def main():
    rows = []
    for lib in ("default", "cublaslt"):
        torch.backends.cuda.preferred_blas_library("cublaslt" if lib == "cublaslt" else "cublas")
        for name, (n, k) in SHAPES.items():
            copies = max(2, -(-200_000_000 // (n * k * 2)))
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in ROWS:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
                fns = [lambda x=x, w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)] * (
                    1 if m >= 4096 else 4)
                t = graph_us(fns, reps=3)
                by = (n * k + m * k + m * n) * 2
                fl = 2 * m * n * k
                floor = max(by / BW, fl / FL) * 1e6
                rows.append((lib, name, m, t, by / t / 1e6, fl / t / 1e6, floor / t))
                del x, outs
            del ws
            torch.cuda.empty_cache()
    print("\n| blas | linear | rows | us | TB/s | TFLOP/s | floor/time |\n|---|---|---|---|---|---|---|")
    for lib, name, m, t, tb, tf, fr in rows:
        print(f"| {lib} | {name} | {m} | {t:.1f} | {tb:.2f} | {tf:.0f} | {fr:.0%} |")


if __name__ == "__main__":
    main()
