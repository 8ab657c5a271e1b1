"""The int4 GEMM's launches (kernels/wna16_mma.py): its tile settings, the H200-measured pick per weight
shape and row count, and the rule for other shapes.

Measured (scripts/gpu_wna16_mma.py, BENCHMARKS.md issue 19, "the one-dot-a-step int4 GEMM"). Past the table's rows the dequantized scratch + cuBLAS (kernels/wna16_gemm.py) is as fast or faster:
there the GEMM's FLOPs, not the weight bytes, set the time.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.envs import environment_variables
from pagedllm.kernels.launch_table import pick_bucket, read_launch_table

__all__ = ["TABLE", "MMAConfig", "mma_choice", "mma_rule"]


class MMAConfig(NamedTuple):
    """One launch of `_wna16_mma_kernel`."""

    BLOCK_M: int  # rows of x per program: wgmma's N, 16..256
    BLOCK_N: int  # output columns per program: wgmma's M, a multiple of 64
    SPLIT_K: int  # programs sharing a tile's K (asked; fewer when K has fewer steps)
    num_warps: int
    num_stages: int
    BLOCK_KW: int = 16  # word rows a step: BLOCK_K = 8 * BLOCK_KW inputs (must divide the group size)


_S = MMAConfig
Bucket = tuple[int, MMAConfig | None]
# (N, K) -> ((max rows, config or None = the path before this kernel), ...) in increasing max rows; rows past
# the last bucket take the path before (the dequantized scratch + cuBLAS). H200, 2026-12-02, the sweep's
# rounds 1 (rows 16, 32, 64, 96, 128, 192, 256, 512, 1024, 2048; 8B and 72B) and 2 (8B: 96, 128, 160, 192,
# 224, 256, 384, 512, 1024, K split up to 8 ways) and 3 (8B: 16 .. 384 rows, 64-input steps too), each bucket
# the fastest there.
TABLE: dict[tuple[int, int], tuple[Bucket, ...]] = {
    (6144, 4096): ((16, _S(16, 64, 4, 4, 3)), (32, _S(32, 64, 4, 4, 3)), (64, _S(64, 64, 4, 4, 3)),
                   (128, _S(128, 64, 4, 4, 3, 8)), (192, None), (224, _S(128, 128, 8, 8, 3)), (2048, None)),  # Llama-3.1-8B qkv
    (4096, 4096): ((16, _S(16, 64, 8, 4, 3)), (32, _S(32, 64, 8, 4, 3)), (64, _S(64, 64, 4, 4, 3)),
                   (128, _S(128, 64, 4, 4, 3, 8)), (192, _S(256, 64, 2, 8, 3, 8)), (224, _S(128, 64, 2, 4, 3)),
                   (2048, None)),  # 8B o
    (28672, 4096): ((16, _S(16, 64, 2, 4, 3)), (32, _S(32, 64, 2, 4, 3)), (64, _S(64, 128, 1, 4, 4, 8)),
                    (96, _S(128, 128, 4, 8, 3)), (128, _S(128, 128, 1, 8, 3)), (160, _S(256, 128, 2, 8, 4, 8)),
                    (192, _S(256, 128, 4, 8, 3)), (224, _S(256, 128, 1, 8, 3)), (256, _S(256, 128, 8, 8, 3)),
                    (384, None), (512, _S(256, 128, 1, 8, 3)), (2048, None)),  # 8B gate_up
    (4096, 14336): ((16, _S(16, 64, 8, 4, 3)), (32, _S(32, 64, 8, 4, 3)), (64, _S(64, 64, 4, 4, 3)),
                    (96, _S(128, 64, 4, 4, 3, 8)), (128, _S(128, 64, 4, 4, 4, 8)), (160, None),
                    (256, _S(256, 64, 2, 8, 4, 8)), (384, _S(128, 64, 2, 4, 3, 8)), (2048, None)),  # 8B down
    (10240, 8192): ((16, _S(16, 64, 4, 4, 3)), (32, _S(32, 64, 4, 4, 3)), (64, _S(64, 64, 4, 4, 3)),
                    (128, _S(128, 128, 1, 8, 3)), (192, None), (256, _S(256, 128, 1, 8, 3)), (2048, None)),  # Qwen2.5-72B qkv
    (8192, 8192): ((16, _S(16, 64, 4, 4, 3)), (32, _S(32, 64, 4, 4, 3)), (64, _S(64, 64, 4, 4, 2)),
                   (128, _S(128, 64, 2, 4, 3)), (256, _S(128, 128, 1, 8, 3)), (512, _S(256, 128, 1, 8, 3)),
                   (2048, None)),  # 72B o
    (59136, 8192): ((16, _S(16, 64, 2, 4, 3)), (32, _S(32, 64, 2, 4, 3)), (64, _S(64, 64, 1, 4, 3)),
                    (128, _S(128, 128, 1, 8, 3)), (192, _S(256, 128, 2, 8, 3)), (512, _S(256, 128, 1, 8, 3)),
                    (2048, None)),  # 72B gate_up
    (8192, 29568): ((16, _S(16, 64, 4, 4, 3)), (32, _S(32, 64, 4, 4, 3)), (64, _S(64, 64, 4, 4, 2)),
                    (128, _S(128, 64, 2, 4, 3)), (256, _S(256, 128, 2, 8, 3)), (1024, _S(256, 128, 1, 8, 3)),
                    (2048, None)),  # 72B down
}
WIDE_N = 10000  # outputs from which a shape counts as wide (gate_up-like) in the rule


def mma_rule(m: int, n: int, k: int) -> MMAConfig | None:
    """The table's pattern for shapes it does not hold: tiles of the smallest BLOCK_M in 16 / 32 / 64
    holding m, 64 columns, K split 4 ways for < 200 column blocks (2 below 500); then 64 x 64 (narrow N)
    or 128 x 128 tiles to 128 rows, 128 x 64 or 256 x 128 to 256; past that wide shapes to 1024 rows, narrow
    ones none (the scratch). Example: (8, 5120, 5120) -> 16 x 64, split 4; (300, 5120, 5120) -> None."""
    if m <= 64:
        blocks = -(-n // 64)
        split = 4 if blocks < 200 else 2 if blocks < 500 else 1
        return _S(16 if m <= 16 else 32 if m <= 32 else 64, 64, split, 4, 3)
    wide = n >= WIDE_N
    if m <= 128:
        return _S(128, 128, 1, 8, 3) if wide else _S(64, 64, 2, 4, 3)
    if m <= 256:
        return _S(256, 128, 2, 8, 3) if wide else _S(128, 64, 2, 4, 3)
    return _S(256, 128, 1, 8, 3) if wide and m <= 1024 else None


_TABLE_FILE = environment_variables["PAGEDLLM_WNA16_MMA_TABLE"]()
if _TABLE_FILE:
    TABLE = read_launch_table(_TABLE_FILE, MMAConfig, "PAGEDLLM_WNA16_MMA_TABLE")


def mma_choice(m: int, n: int, k: int) -> MMAConfig | None:
    """The int4 GEMM's configuration for an (m, N, K) call, or None where the path before it is faster.
    Example: (100, 4096, 14336) -> 128 x 64 tiles, K split 4, 64-input steps (the table); (300, 4096, 14336) -> None."""
    buckets = TABLE.get((n, k))
    if buckets is None:
        return mma_rule(m, n, k)
    return pick_bucket(buckets, m)
