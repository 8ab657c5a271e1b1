"""The one-row int4 stream kernel's launch (kernels/wna16_stream.py): its tile settings, the steps a
program takes, which calls it serves, and the H200-measured launch per weight shape."""

from __future__ import annotations

from typing import NamedTuple

import torch

from pagedllm.kernels.wna16_mma8 import MMA8Config
from pagedllm.kernels.wna16_tc import TCConfig

__all__ = ["StreamConfig", "program_steps", "stream_config", "stream_supported"]


class StreamConfig(NamedTuple):
    BLOCK_N: int  # output columns per program
    STEPS: int  # group-aligned BLOCK_K steps per program (the loop is unrolled); fewer when K has fewer
    num_warps: int
    BLOCK_KW: int = 16  # word rows a step (BLOCK_K = 8 * BLOCK_KW inputs, dividing the group size)
    # Both measured slower on the H200 at every 8B shape (BENCHMARKS.md, h40); kept for sweeps elsewhere.
    STEP_SUMS: bool = False  # offsets / zero points from whole-step x sums (block reductions), not per word row
    PREFETCH: bool = False  # issue step i + 1's word / scale loads before step i's arithmetic
    num_stages: int = 1  # no loop-carried pipeline: the programs in flight hide the latency
    # "fp32": one FFMA a value; "f16x2": packed fp16 math on pairs of values (module docstring), x
    # scaled by the program's power of two
    MATH: str = "fp32"
    ROWS: int = 1  # f16x2: word rows (8 inputs each) summed in fp16 before the sum joins fp32 (1, 2, 4)
    # f16x2: the x pairs of the program's inputs made once up front and stored to a small global
    # scratch (re-read per step from L1), instead of per step as a tile moved between threads
    X_SCRATCH: bool = False
    # f16x2: scales and zero points loaded in the word tile's layout, each row of the tile the same
    # (no exchange between threads a step; redundant loads where a thread holds several tile rows)
    SZ_TILE: bool = False
    # f16x2: the first step's words loaded before the x prologue, so their DRAM latency overlaps it
    EARLY: bool = False
    # f16x2: the layer before may hand its residual add + RMSNorm to this launch's prologue
    # (`wna16_stream_linear_rms_norm`; WNA16LinearMethod.fuses_rms_norm reads it)
    FUSE_NORM: bool = True


def program_steps(cfg: StreamConfig, k: int) -> int:
    """The BLOCK_K steps one program takes: cfg.STEPS, fewer where K has fewer or where they would not
    divide K's steps (whole programs: no masked K tail; a power of two stays one)."""
    steps_total = k // (cfg.BLOCK_KW * 8)
    steps = max(1, min(cfg.STEPS, steps_total))
    while steps_total % steps:
        steps //= 2
    return steps


def stream_supported(x: torch.Tensor, bits: int, group_size: int, k: int) -> bool:
    """One row, int4, groups (and K) a whole number of 128-input steps; 16-bit x (fp32 too off the
    GPU, in the interpreter), as the tensor-core kernel this falls back to."""
    dtype_ok = x.dtype in (torch.bfloat16, torch.float16) or (x.dtype == torch.float32 and not x.is_cuda)
    return x.shape[0] == 1 and bits == 4 and dtype_ok and group_size % 128 == 0 and k % 128 == 0


# One-row launch table keyed by (N, K), from the H200 sweeps of scripts/gpu_wna16_stream.py (h40) and
# scripts/gpu_wna16_packed.py (h44, 2026-12-02 rounds 1-2; BENCHMARKS.md, issue 19; CUDA-graph replays
# over rotating weight copies), microseconds:
#   qkv  6144 x 4096    f16x2, 256 columns, 4 warps, 2 steps, 2 rows, first loads early: with the
#                       residual add + RMSNorm in its prologue 10.5 (rms_norm launch + GEMV 13.7);
#                       alone 10.4-12.0 (the fp32 path 10.9)
#   o    4096 x 4096    fp32, 128 columns, 4 warps, 2 steps              8.2-8.3 (f16x2 best 9.4)
#   gate_up 28672 x 4096  f16x2, 64 columns, 2 warps, 8 steps, 2 rows: with the norm in its prologue
#                       28.4 (launch + GEMV 35.9; the same with the first loads early 35.0); alone 25.2
#                       (the tensor-core kernel 32.9)
#   down 4096 x 14336   f16x2, 64 columns, 2 warps, 4 steps, 2 rows    15.9 (fp32 path 19.3)
# Other shapes: 128 columns, 4 warps, 2 steps (fp32), the best over h40's four shapes together.
_TABLE: dict[tuple[int, int], StreamConfig | TCConfig | MMA8Config] = {
    (6144, 4096): StreamConfig(256, 2, 4, MATH="f16x2", ROWS=2, EARLY=True),
    (4096, 4096): StreamConfig(128, 2, 4),
    (28672, 4096): StreamConfig(64, 8, 2, MATH="f16x2", ROWS=2),
    (4096, 14336): StreamConfig(64, 4, 2, MATH="f16x2", ROWS=2),
}
_DEFAULT = StreamConfig(128, 2, 4)


def stream_config(n: int, k: int) -> StreamConfig | TCConfig | MMA8Config:
    """The one-row launch for an (N, K) int4 weight: a StreamConfig for this kernel, a TCConfig where the
    tensor-core kernel (wna16_tc.py) measured faster, an MMA8Config where the mma.sync one (wna16_mma8.py) did."""
    return _TABLE.get((n, k), _DEFAULT)
