"""BlockPool: ref counts, free-queue order (empty blocks first, cached ones LRU), eviction."""
from __future__ import annotations

import pytest

from slipstream.kv_cache.block_pool import BlockPool
from slipstream.kv_cache.hashing import hash_block_tokens, hash_request_tokens


def _h(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def test_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    ids = pool.allocate(3)
    assert ids == [0, 1, 2]
    assert pool.num_free_blocks == 1
    assert [pool.ref_cnt[b] for b in ids] == [1, 1, 1]
    pool.touch([1])
    assert pool.ref_cnt[1] == 2
    pool.free(ids)
    assert pool.ref_cnt == [0, 1, 0, 0]
    assert pool.num_free_blocks == 3
    pool.free([1])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([1])
    with pytest.raises(ValueError, match="only 4 free"):
        pool.allocate(5)


def test_cached_blocks_evicted_least_recently_freed_first():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for b in ids:
        assert pool.cache_block(b, _h(b))
    for b in (2, 0, 3, 1):  # free order = LRU order
        pool.free([b])
    assert pool.free_queue() == [2, 0, 3, 1]
    assert pool.allocate(1) == [2]
    assert pool.get_cached_block(_h(2)) is None  # eviction removed its hash
    assert pool.get_cached_block(_h(0)) == 0  # the others are still reusable
    assert pool.allocate(2) == [0, 3]
    assert pool.get_cached_block(_h(1)) == 1
    assert pool.num_cached_blocks == 1


def test_empty_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    pool.cache_block(a, _h(a))
    pool.free([a])  # cached: tail
    pool.free([b])  # empty: head
    pool.free([c])
    assert pool.free_queue() == [c, b, a]
    assert pool.allocate(2) == [c, b]
    assert pool.get_cached_block(_h(a)) == a


def test_touch_revives_a_freed_cached_block():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, _h(a))
    pool.free([a, b, c])
    pool.touch([a])  # a prefix hit takes it off the free queue
    assert pool.ref_cnt[a] == 1
    assert a not in pool.free_queue()
    assert pool.allocate(2) == [c, b]  # does not evict a
    assert pool.get_cached_block(_h(a)) == a


def test_duplicate_hash_stays_private_and_uncache():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    assert pool.cache_block(a, _h(7))
    assert not pool.cache_block(b, _h(7))  # one block per hash
    assert pool.block_hash[b] is None
    pool.uncache_block(a)
    assert pool.get_cached_block(_h(7)) is None
    pool.cache_block(b, _h(7))
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.block_hash == [None] * 3


def test_caching_disabled():
    pool = BlockPool(2, enable_caching=False)
    a, _ = pool.allocate(2)
    assert not pool.cache_block(a, _h(1))
    assert pool.get_cached_block(_h(1)) is None


def test_chained_hashes_depend_on_whole_prefix_and_salt():
    x = hash_request_tokens([1, 2, 3, 4, 5, 6, 7], 2)
    assert len(x) == 3  # the partly filled last block is not hashed
    y = hash_request_tokens([9, 9, 3, 4, 5, 6], 2)
    assert x[0] != y[0] and x[1] != y[1]  # same block tokens, different prefix
    assert hash_request_tokens([1, 2, 3, 4], 2) == x[:2]
    salted = hash_request_tokens([1, 2, 3, 4], 2, extra_key="tenant-a")
    assert salted[0] != x[0] and salted[1] != x[1]
    assert hash_request_tokens([1, 2, 3, 4], 2, extra_key="tenant-a") == salted
    # Fixed-width fields: [1, 2] then [3] is not [1] then [2, 3].
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1])
