"""The Gluon int4 GEMM's launches (kernels/wna16_wgmma.py): its tile settings, the measured pick per
weight shape and row count, and the file that replaces them in tuning runs.

Measured by scripts/gpu_wna16_wgmma.py (BENCHMARKS.md issue 19, "the int4 GEMM in wgmma's register
layout"). A shape or row count the table does not hold goes to the Triton kernels (kernels/wna16_mma.py's
table and rule, then the dequantized scratch): this kernel is only taken where it was measured faster.
Kept apart from the kernel so that the dispatch reads it without importing Gluon.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.envs import environment_variables
from pagedllm.kernels.launch_table import pick_bucket, read_launch_table

__all__ = ["TABLE", "WGMMAConfig", "wgmma_choice"]


class WGMMAConfig(NamedTuple):
    """One launch of `_wna16_wgmma_kernel`."""

    BLOCK_M: int  # rows of x a program: wgmma's N, a power of two 16..256
    BLOCK_N: int  # output columns a program: wgmma's M, a multiple of 16 x num_warps
    SPLIT_K: int  # programs sharing a tile's K (asked; fewer when K has fewer steps)
    num_warps: int  # 4 or 8 (one or two warpgroups stacked along N)
    STAGES: int  # cp.async ring depth (>= 2)
    BLOCK_KW: int = 16  # word rows a step: BLOCK_K = 8 * BLOCK_KW inputs (8 or 16)


_W = WGMMAConfig  # the table's entries (scripts/gpu_wna16_wgmma.py prints them in this form)
Bucket = tuple[int, WGMMAConfig | None]
# (N, K) -> ((max rows, config or None = the Triton kernels), ...) in increasing max rows; rows past the
# last bucket take the Triton kernels. Measured on an H100 80GB HBM3 (BENCHMARKS.md, issue 19, twenty-second
# session): every candidate's answer checked against the fp32 reference first, a bucket kept only where the
# kernel beat the Triton dispatch; a PAGEDLLM_WNA16_WGMMA_TABLE file replaces it.
TABLE: dict[tuple[int, int], tuple[Bucket, ...]] = {
    (6144, 4096): ((16, None), (32, _W(32, 64, 4, 4, 3)), (128, None), (192, _W(128, 128, 1, 8, 4)), (224, None),
                   (256, _W(128, 64, 1, 4, 3))),  # Llama-3.1-8B qkv
    (4096, 4096): ((16, _W(16, 64, 8, 4, 3)), (32, _W(32, 64, 4, 4, 3)), (64, None), (96, _W(128, 64, 2, 4, 4)),
                   (128, _W(64, 64, 2, 4, 4)), (192, _W(128, 64, 1, 4, 3)), (224, _W(128, 64, 1, 4, 4)),
                   (256, _W(128, 64, 1, 4, 3))),  # Llama-3.1-8B o
    (28672, 4096): ((16, _W(16, 64, 1, 4, 4)), (32, _W(32, 64, 1, 4, 4)), (96, None), (128, _W(128, 64, 1, 4, 3)),
                    (160, None), (192, _W(256, 128, 1, 8, 4, 8)), (256, None), (320, _W(128, 64, 1, 4, 3)),
                    (384, _W(128, 64, 4, 4, 3)), (512, _W(256, 128, 1, 8, 4, 8))),  # Llama-3.1-8B gate_up
    (4096, 14336): ((16, _W(16, 64, 8, 4, 3)), (32, _W(32, 64, 8, 4, 3)), (64, _W(64, 64, 4, 4, 4)),
                    (128, _W(128, 64, 4, 4, 3)), (192, _W(128, 64, 2, 4, 3)), (224, _W(128, 128, 2, 8, 4)),
                    (256, _W(128, 64, 2, 4, 3)), (384, None), (512, _W(256, 128, 2, 8, 3, 8))),  # Llama-3.1-8B down
}


_TABLE_FILE = environment_variables["PAGEDLLM_WNA16_WGMMA_TABLE"]()
if _TABLE_FILE:
    TABLE = read_launch_table(_TABLE_FILE, WGMMAConfig, "PAGEDLLM_WNA16_WGMMA_TABLE")


def wgmma_choice(m: int, n: int, k: int) -> WGMMAConfig | None:
    """The Gluon GEMM's launch for an (m, N, K) call, or None where the Triton kernels are taken."""
    return pick_bucket(TABLE.get((n, k), ()), m)
