"""The grouped program order (kernels/tile_order.py) the tiled GEMMs share, under the interpreter on CPU,
against its Python reference: every (row block, column block) once, GROUP_M row blocks down a column."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from pagedllm.kernels.tile_order import grouped_tile, grouped_tile_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _order_kernel(out_ptr, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    pm, pn = grouped_tile(pid, num_m_blocks, num_n_blocks, GROUP_M)
    tl.store(out_ptr + 2 * pid, pm)
    tl.store(out_ptr + 2 * pid + 1, pn)


@pytest.mark.parametrize("num_m, num_n, group_m", [(3, 2, 2), (5, 3, 2), (7, 4, 8), (1, 5, 8), (9, 1, 4)])
def test_grouped_tile_matches_reference_and_covers_every_tile(num_m, num_n, group_m):
    out = torch.full((num_m * num_n, 2), -1, dtype=torch.int32, device=DEVICE)
    _order_kernel[(num_m * num_n,)](out, num_m, num_n, GROUP_M=group_m)
    got = [tuple(r) for r in out.cpu().tolist()]
    assert got == [grouped_tile_ref(p, num_m, num_n, group_m) for p in range(num_m * num_n)]
    assert sorted(got) == [(m, n) for m in range(num_m) for n in range(num_n)]


def test_grouped_tile_worked_example():
    # the docstring's: GROUP_M 2, 3 row x 2 column blocks
    assert [grouped_tile_ref(p, 3, 2, 2) for p in range(6)] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (2, 1)]
