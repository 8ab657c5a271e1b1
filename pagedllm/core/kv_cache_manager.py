"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing.

Sliding-window models (every attention layer windowed: Mistral v0.1, Phi-3-mini; vLLM's
SlidingWindowManager) free a request's blocks once they leave the window: a query at position p
reads keys p - W + 1 .. p only, so when a step starts at position c every block wholly below
c - W + 1 is dead for the rest of the request. A request then holds about (W + chunk) / block_size
blocks whatever its length (Mistral v0.1 at 32K tokens, blocks of 16: 769 with 8192-token chunks,
258 while decoding, instead of 2,048). Freeing runs on allocate_slots' slow path, i.e. whenever a
block fills or a new one is needed, so a decode frees its dead block at most one block late.
Freed leading positions are counted in `num_skipped_blocks`, not kept in `req_to_blocks`; the
worker's block table reads block id 0 there (never written through: new tokens are inside the
window; read only by the kernels' masked edge tiles, so any finite content is fine).

    window 8, block_size 4, a step starting at c = 13: keys 6 .. are needed, so block 0 (0..3) is
    freed and block 1 (4..7) kept; num_skipped_blocks 1, block ids [0, b1, b2, b3]

Models that mix windowed and global layers (Gemma 2/3, Qwen2 with max_window_layers) share one
block table across layers, and the global layers need every block: nothing is freed for them
(`sliding_window` None here; vLLM's hybrid KV cache groups would give the windowed layers their
own tables, not built). Prefix caching stays on: a cached prefix only needs its last window's
blocks (`_find_windowed_hit`), the ones before it read as skipped.
"""

from __future__ import annotations

import pagedllm.envs as envs
from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks_per_request(num_tokens: int, block_size: int, sliding_window: int | None, max_batched: int) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once. Behind a sliding window W that
    is the window plus one step's chunk, whatever its length: a step from position c to c + n - 1
    (n <= max_batched) holds positions (c - W + 1) // bs .. (c + n - 1) // bs (vLLM's SlidingWindowSpec)."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    return min(full, cdiv(sliding_window - 1 + max_batched, block_size) + 1)


# Stands for a skipped position in a windowed prefix hit (get_computed_blocks); never in the pool.
NULL_BLOCK = KVCacheBlock(-1)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}.")
        self.block_size = block_size
        # Set only when every attention layer has a window this large or smaller (see the docstring).
        self.sliding_window = sliding_window
        # Leading block positions of a request that were freed (or never allocated: a prefix hit's or
        # a resumed request's positions before its window); req_to_blocks holds the ones after.
        self.num_skipped_blocks: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the prefix cache already.
        self.num_cached_block: dict[str, int] = {}
        # Prefix-cache statistics, in tokens (vLLM's prefix_cache_queries / prefix_cache_hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.debug = envs.PAGEDLLM_DEBUG_BLOCKS

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    # -- hashing ---------------------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        """Extend request.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            salt = request.cache_salt if i == 0 else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs], salt))

    # -- lookup ----------------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute so the
        step still produces logits. Returns (blocks, num_computed_tokens)."""
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0  # every prompt position must run to give its logprobs (vLLM skips the cache too)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        if self.sliding_window is not None:
            hits = self._find_windowed_hit(request.block_hashes[:max_blocks])
        else:
            for h in request.block_hashes[:max_blocks]:
                b = self.block_pool.get_cached_block(h)
                if b is None:
                    break
                hits.append(b)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _find_windowed_hit(self, hashes: list) -> list[KVCacheBlock]:
        """The longest cached prefix of a windowed model: only the blocks the next query's window
        reads must be cached, cdiv(W - 1, block_size) of them right before the hit's end; earlier
        positions come back as NULL_BLOCK (skipped). Scanned from the right, as vLLM does.

            W 8, block_size 4 -> 2 blocks needed; cached [T, F, T, T, F]: hit of 4 blocks,
            [NULL, NULL, b2, b3] (the query at 16 reads keys 9.., blocks 2 and 3)
        """
        need = cdiv(self.sliding_window - 1, self.block_size)
        run: list[KVCacheBlock] = []  # the contiguous cached blocks ending at the scan position
        for i in range(len(hashes) - 1, -1, -1):
            b = self.block_pool.get_cached_block(hashes[i])
            if b is None:
                run = []
                continue
            run.append(b)
            if len(run) >= need:
                return [NULL_BLOCK] * i + run[::-1]
        return run[::-1]  # a run reaching block 0 is a hit even when shorter than the window

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (and any prefix hits).

        Returns the newly allocated blocks, or None (and changes nothing) if the pool is short.
        """
        rid = request.request_id
        if not new_computed_blocks:
            # Fast path, most decode steps: the tokens fit the blocks the request already holds
            # and no block fills up, so nothing changes.
            held = self.req_to_blocks.get(rid)
            end = request.num_computed_tokens + num_new_tokens
            if (
                held is not None
                and end <= (self.num_skipped_blocks.get(rid, 0) + len(held)) * self.block_size
                and (not self.enable_caching or end // self.block_size <= self.num_cached_block.get(request.request_id, 0))
            ):
                return []
        new_computed_blocks = new_computed_blocks or []
        existing = rid in self.req_to_blocks
        req_blocks = self.req_to_blocks.setdefault(rid, [])
        windowed = self.sliding_window is not None
        if existing and windowed:
            # Blocks behind the window of the step's first query are dead whatever happens next.
            self._free_skipped(rid, req_blocks, request.num_computed_tokens)
        skipped = self.num_skipped_blocks.get(rid, 0)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        if not existing and windowed:
            # A windowed prefix hit starts with NULL_BLOCKs, a resumed request (swap) may start past
            # its window: those positions are skipped, never allocated. Hits (from position 0) that
            # no query will read are not taken either.
            lead = next((i for i, b in enumerate(new_computed_blocks) if b is not NULL_BLOCK), len(new_computed_blocks))
            skipped = max(lead, self._num_skipped(num_computed))
            new_computed_blocks = new_computed_blocks[skipped:]
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - skipped - len(req_blocks) - len(new_computed_blocks)
        # Touching a cached-but-free hit takes it out of the free queue too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not existing:
                del self.req_to_blocks[rid]
            return None
        if skipped:
            self.num_skipped_blocks[rid] = skipped
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks whose tokens are all known after this step get their hash now, so a request
            # scheduled later in the same step (n > 1 siblings) already hits them.
            self.update_block_hashes(request)
            num_full = min((num_computed + num_new_tokens) // self.block_size, len(request.block_hashes))
            start = self.num_cached_block.get(rid, 0)
            for i in range(max(start, skipped), num_full):
                self.block_pool.cache_block(req_blocks[i - skipped], request.block_hashes[i])
            self.num_cached_block[rid] = max(start, num_full)
        return new_blocks

    def _num_skipped(self, num_computed_tokens: int) -> int:
        """Leading blocks no query from position `num_computed_tokens` on reads (0 without a window):
        keys below num_computed_tokens - W + 1 are outside every later query's window."""
        if self.sliding_window is None:
            return 0
        return max(num_computed_tokens - self.sliding_window + 1, 0) // self.block_size

    def _free_skipped(self, rid: str, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        skipped = self.num_skipped_blocks.get(rid, 0)
        k = min(self._num_skipped(num_computed_tokens) - skipped, len(req_blocks))
        if k <= 0:
            return
        # Oldest first: they join the free queue's tail in position order, keeping their prefix hash
        # (a later request's windowed hit can still take back the newest of them).
        self.block_pool.free_blocks(req_blocks[:k])
        del req_blocks[:k]
        self.num_skipped_blocks[rid] = skipped + k

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.num_skipped_blocks.pop(request.request_id, None)
        # Tail first: the tail is the least likely to be shared, so it should be evicted first.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str, skipped_id: int = 0) -> list[int]:
        """The request's block table by position; skipped positions (freed behind a window) read
        `skipped_id`: 0 for the worker's table (a harmless read, see the module docstring), -1 for
        the swap policy (nothing to copy)."""
        ids = [b.block_id for b in self.req_to_blocks.get(request_id, [])]
        skipped = self.num_skipped_blocks.get(request_id, 0)
        return [skipped_id] * skipped + ids if skipped else ids

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds now (skipped positions excluded)."""
        return len(self.req_to_blocks.get(request_id, []))

    def check_invariants(self) -> None:
        self.block_pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in self.block_pool.blocks:
            assert refs.get(b.block_id, 0) == b.ref_cnt, f"{b}: held by {refs.get(b.block_id, 0)} requests"
            if b.ref_cnt > 1:
                assert b.block_hash is not None, f"{b} shared by several requests without a prefix hash"
        if not self.req_to_blocks:
            assert self.block_pool.get_num_free_blocks() == self.num_blocks, "idle pool is not full"
