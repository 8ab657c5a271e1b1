import pytest

from pagedllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def test_free_queue_pop_order_and_middle_removal():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])  # O(1) removal from the middle
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    assert q.num_free_blocks == 4


def test_pool_refcounts_and_invariants():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    pool.touch([a[0]])  # shared
    pool.free_blocks([a[0]])
    assert a[0].ref_cnt == 1
    pool.free_blocks(reversed(a))
    pool.check_invariants()
    assert pool.get_num_free_blocks() == 4
    # tail first: the last block of the request is evicted first
    assert [b.block_id for b in pool.free_block_queue][-3:] == [a[2].block_id, a[1].block_id, a[0].block_id]


def test_cached_free_block_is_a_hit_until_reused():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    pool.cache_block(b, h)
    pool.free_blocks([b])
    assert pool.get_cached_block(h) is b
    pool.touch([b])  # hit: leaves the free queue
    assert pool.get_num_free_blocks() == 1
    pool.free_blocks([b])
    pool.get_new_blocks(2)  # reuse evicts the hash
    assert pool.get_cached_block(h) is None


def test_hash_chain_depends_on_parent_and_salt():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2], "salt") != h1
    assert hash_block_tokens(None, [1, 2]) == h1
