"""The web console's KV block map (core/kv_snapshot.py) against block states built by hand and
by the real KV cache manager."""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm.core.block_pool import KVCacheBlock
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_snapshot import build_kv_block_map
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams


def cells(m) -> np.ndarray:
    return np.frombuffer(m.cells, dtype=np.uint8).reshape(-1, 4)


def test_worked_example_of_the_docstring():
    b = [KVCacheBlock(i) for i in range(8)]
    cached = np.zeros(8, dtype=bool)
    cached[6] = True
    m = build_kv_block_map(8, {"A": [b[0], b[1], b[2]], "B": [b[0], b[1], b[5]]}, cached, max_cells=4)
    assert (m.num_blocks, m.blocks_per_cell, m.num_cells) == (8, 2, 4)
    assert cells(m).tolist() == [[255, 255, 0, 2], [128, 0, 0, 1], [128, 0, 0, 1], [0, 0, 128, 0]]


def test_one_cell_per_block_and_a_short_last_cell():
    b = [KVCacheBlock(i) for i in range(10)]
    m = build_kv_block_map(10, {"A": [b[9]]}, np.zeros(10, dtype=bool), max_cells=16)
    assert m.blocks_per_cell == 1 and cells(m)[9].tolist() == [255, 0, 0, 1] and not cells(m)[:9].any()
    # 10 blocks in 4 cells of 3: the last cell has one block, so that block in use is a full cell.
    m = build_kv_block_map(10, {"A": [b[9]]}, np.zeros(10, dtype=bool), max_cells=4)
    assert m.blocks_per_cell == 3 and m.num_cells == 4 and cells(m)[3].tolist() == [255, 0, 0, 1]
    with pytest.raises(ValueError, match="max_cells"):
        build_kv_block_map(10, {}, np.zeros(10, dtype=bool), max_cells=0)


def test_map_of_a_real_pool_with_prefix_sharing():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    params = SamplingParams(max_tokens=4)
    prompt = list(range(12))  # 3 full blocks
    a = Request("a", prompt, params)
    kv.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    b = Request("b", prompt + [99], params)
    hits, n = kv.get_computed_blocks(b)
    assert n == 12  # all three full blocks hit (the 13th token is computed)
    kv.allocate_slots(b, 13 - n, hits)
    kv.check_invariants()  # includes the cached_mask being in sync
    m = build_kv_block_map(kv.num_blocks, kv.req_to_blocks, kv.block_pool.cached_mask)
    c = cells(m)
    assert c[:3].tolist() == [[255, 255, 0, 2]] * 3  # the shared prefix
    assert (c[:, 0] > 0).sum() == len({blk.block_id for blocks in kv.req_to_blocks.values() for blk in blocks})
    kv.free(a)
    kv.free(b)
    kv.check_invariants()
    c = cells(build_kv_block_map(kv.num_blocks, kv.req_to_blocks, kv.block_pool.cached_mask))
    assert not c[:, 0].any()  # nothing in use
    assert (c[:, 2] == 255).sum() == 3  # a's three full blocks stay cached, free
