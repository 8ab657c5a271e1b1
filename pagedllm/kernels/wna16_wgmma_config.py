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
# last bucket take the Triton kernels. Empty: the kernel's current loop has not been checked and timed on a
# GPU yet (BENCHMARKS.md, issue 19, twenty-first session); a PAGEDLLM_WNA16_WGMMA_TABLE file fills it.
TABLE: dict[tuple[int, int], tuple[Bucket, ...]] = {}


_TABLE_FILE = environment_variables["PAGEDLLM_WNA16_WGMMA_TABLE"]()
if _TABLE_FILE:
    TABLE = read_launch_table(_TABLE_FILE, WGMMAConfig, "PAGEDLLM_WNA16_WGMMA_TABLE")


def wgmma_choice(m: int, n: int, k: int) -> WGMMAConfig | None:
    """The Gluon GEMM's launch for an (m, N, K) call, or None where the Triton kernels are taken."""
    return pick_bucket(TABLE.get((n, k), ()), m)
