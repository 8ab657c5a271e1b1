"""A compact picture of the KV block pool for the web console: one cell per block, or per run of
blocks when the pool is large.

A GPU cache holds ~10^5-10^6 blocks, so the map is aggregated into at most `max_cells` cells of
`blocks_per_cell` consecutive block ids. Each cell is 4 bytes:

    used    blocks held by at least one request,    scaled to 0..255 of the cell's blocks
    shared  blocks held by two or more requests,    scaled to 0..255
    cached  free blocks that still hold a prefix,   scaled to 0..255 (a later hit takes them back)
    max_ref the largest number of requests holding one block of the cell (capped at 255)

Worked example, 8 blocks, 4 cells of 2 blocks; request A holds [0, 1, 2], B holds [0, 1, 5];
block 6 was freed with its prefix hash kept:

    ref counts  [2, 2, 1, 0, 0, 1, 0, 0]     cached [F, F, F, F, F, F, T, F]
    cells       (255, 255, 0, 2) (128, 0, 0, 1) (128, 0, 0, 1) (0, 0, 128, 0)

The cost is a few vectorised passes over `num_blocks` bytes plus one Python pass over the block
ids the requests hold (not over the whole pool), so the engine can afford it a few times a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.core.block_pool import KVCacheBlock

DEFAULT_MAX_CELLS = 4096
CELL_BYTES = 4


@dataclass(frozen=True)
class KVBlockMap:
    num_blocks: int
    blocks_per_cell: int
    cells: bytes  # CELL_BYTES per cell, layout in the module docstring

    @property
    def num_cells(self) -> int:
        return len(self.cells) // CELL_BYTES


def build_kv_block_map(
    num_blocks: int,
    req_to_blocks: dict[str, list[KVCacheBlock]],
    cached_mask: np.ndarray,
    max_cells: int = DEFAULT_MAX_CELLS,
) -> KVBlockMap:
    """The map of a pool of `num_blocks` blocks, from the blocks each request holds and the pool's
    mask of blocks that carry a prefix hash (`BlockPool.cached_mask`)."""
    if max_cells < 1:
        raise ValueError(f"max_cells must be >= 1, got {max_cells}.")
    held = [b.block_id for blocks in req_to_blocks.values() for b in blocks]
    refs = np.bincount(np.asarray(held, dtype=np.intp), minlength=num_blocks) if held else np.zeros(num_blocks, np.intp)
    per_cell = -(-num_blocks // max_cells)
    num_cells = -(-num_blocks // per_cell)
    pad = num_cells * per_cell - num_blocks

    def cells_of(values: np.ndarray) -> np.ndarray:  # (num_blocks,) -> (num_cells, per_cell)
        return (np.pad(values, (0, pad)) if pad else values).reshape(num_cells, per_cell)

    used_mask = refs >= 1
    used = cells_of(used_mask).sum(axis=1)
    shared = cells_of(refs >= 2).sum(axis=1)
    cached = cells_of(cached_mask[:num_blocks] & ~used_mask).sum(axis=1)
    max_ref = np.minimum(cells_of(refs).max(axis=1), 255) if per_cell > 1 else np.minimum(refs, 255)
    # The last cell may be short: scale by the blocks it really has.
    sizes = np.full(num_cells, per_cell, dtype=np.int64)
    sizes[-1] = per_cell - pad

    def scaled(counts: np.ndarray) -> np.ndarray:
        return (counts * 255 + sizes // 2) // sizes  # rounded to the nearest of 0..255

    out = np.stack([scaled(used), scaled(shared), scaled(cached), max_ref], axis=1).astype(np.uint8)
    return KVBlockMap(num_blocks=num_blocks, blocks_per_cell=per_cell, cells=out.tobytes())
