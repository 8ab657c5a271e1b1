"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, freeing."""

from __future__ import annotations

import pagedllm.envs as envs
from pagedllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from pagedllm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
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
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in request.block_hashes[:max_blocks]:
            b = self.block_pool.get_cached_block(h)
            if b is None:
                break
            hits.append(b)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

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
        if not new_computed_blocks:
            # Fast path, most decode steps: the tokens fit the blocks the request already holds
            # and no block fills up, so nothing changes.
            held = self.req_to_blocks.get(request.request_id)
            end = request.num_computed_tokens + num_new_tokens
            if (
                held is not None
                and end <= len(held) * self.block_size
                and (not self.enable_caching or end // self.block_size <= self.num_cached_block.get(request.request_id, 0))
            ):
                return []
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(new_computed_blocks)
        # Touching a cached-but-free hit takes it out of the free queue too.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks whose tokens are all known after this step get their hash now, so a request
            # scheduled later in the same step (n > 1 siblings) already hits them.
            self.update_block_hashes(request)
            num_full = min((num_computed + num_new_tokens) // self.block_size, len(request.block_hashes))
            start = self.num_cached_block.get(request.request_id, 0)
            for i in range(start, num_full):
                self.block_pool.cache_block(req_blocks[i], request.block_hashes[i])
            self.num_cached_block[request.request_id] = max(start, num_full)
        return new_blocks

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        # Tail first: the tail is the least likely to be shared, so it should be evicted first.
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

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
