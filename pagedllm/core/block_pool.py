"""KV-cache blocks, their free queue (LRU, O(1) removal from the middle) and the prefix-cache map.

A block is free when its ref_cnt is 0. A free block may still hold a cached prefix (its
`block_hash` is set): it stays in `cached_block_hash_to_block` until it is handed out again, so a
later request with the same prefix can take it back out of the free queue (a prefix-cache hit).
Blocks are popped from the front of the free queue, so the least recently freed go first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable

import numpy as np

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra: str | None = None) -> BlockHash:
    """Chained SHA-256 of a full block: hash(parent, tokens, extra keys).

    Chaining makes a block's hash stand for its whole prefix, so equal hashes mean equal prefixes
    (SHA-256: no practical collisions, so no token comparison is needed on a hit).
    """
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\x00salt\x00" + extra.encode())
    return h.digest()


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves (vLLM's design).

    Sentinel head/tail nodes remove every edge case from append/remove.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free_block = b
            b.prev_free_block = prev
            prev = b
        prev.next_free_block = self._tail
        self._tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free_block
        if first is self._tail or first is None:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def __iter__(self):
        b = self._head.next_free_block
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free_block


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        # cached_mask[i]: block i carries a prefix hash (in use or free). Kept beside `block_hash` so
        # that a picture of the pool (core/kv_snapshot.py) needs no pass over every block object.
        self.cached_mask = np.zeros(num_blocks, dtype=bool)

    # -- allocation -------------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot get {n} free blocks from the pool ({self.get_num_free_blocks()} free)")
        out = []
        for _ in range(n):
            b = self.free_block_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
            self.cached_mask[block.block_id] = False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order
        (callers pass a request's blocks tail first, so tails are evicted before shared heads)."""
        for b in ordered_blocks:
            b.ref_cnt -= 1
            assert b.ref_cnt >= 0, f"{b} freed twice"
            if b.ref_cnt == 0:
                self.free_block_queue.append(b)

    # -- prefix cache ------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        if block.block_hash is not None:
            return  # already cached (a hit, or cached on an earlier step)
        if block_hash in self.cached_block_hash_to_block:
            return  # another block already holds this prefix; keep one copy in the map
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        self.cached_mask[block.block_id] = True

    def reset_prefix_cache(self) -> bool:
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.cached_mask[:] = False
        return True

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    # -- debugging ---------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError when the pool is inconsistent (PAGEDLLM_DEBUG_BLOCKS=1 runs this)."""
        seen: set[int] = set()
        for b in self.free_block_queue:
            assert b.block_id not in seen, f"block {b.block_id} twice in the free queue"
            assert b.ref_cnt == 0, f"{b} in the free queue with references"
            seen.add(b.block_id)
        assert len(seen) == self.free_block_queue.num_free_blocks, "free count out of sync"
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"{b} has a negative ref count"
            if b.ref_cnt == 0:
                assert b.block_id in seen, f"{b} is unreferenced but not in the free queue"
        for h, b in self.cached_block_hash_to_block.items():
            assert b.block_hash == h, f"{b} is mapped under a hash it does not carry"
        for b in self.blocks:
            assert self.cached_mask[b.block_id] == (b.block_hash is not None), f"{b}: cached_mask out of sync"
