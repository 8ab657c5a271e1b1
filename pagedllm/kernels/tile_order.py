"""The program order the tiled GEMMs share (kernels/w8a8_gemm.py, kernels/moe_grouped_gemm.py): a 1-d
grid walked in GROUP_M-tall column groups (Triton's matmul tutorial), so the programs running at once
share weight tiles in L2 instead of each streaming its own column.

Reference: `grouped_tile_ref` (the same arithmetic in Python; tests/kernels/test_tile_order.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def grouped_tile(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: programs in groups of GROUP_M row blocks x every
    column block, column-major inside a group, so the row blocks of one group (in fused MoE: of one
    expert with many rows, as DeepSeek's shared experts that take every token) read each weight tile
    at about the same time: from DRAM once, from L2 after. Worked example, GROUP_M 2, 3 row x 2
    column blocks: pids 0..5 -> (m, n) (0,0) (1,0) (0,1) (1,1) (2,0) (2,1)."""
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


def grouped_tile_ref(pid: int, num_m_blocks: int, num_n_blocks: int, group_m: int) -> tuple[int, int]:
    """`grouped_tile` in plain Python."""
    per_group = group_m * num_n_blocks
    first_m = (pid // per_group) * group_m
    group_rows = min(num_m_blocks - first_m, group_m)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows
