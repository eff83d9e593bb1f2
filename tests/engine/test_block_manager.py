"""Block allocator and prefix cache: refcounts, LRU reuse, collision guard."""

from __future__ import annotations

import pytest

from yuebing.core.errors import EngineError
from yuebing.core.hashing import hash_blocks
from yuebing.core.ids import BlockHash
from yuebing.engine.block_manager import BlockAllocator


def test_allocate_release_and_exhaustion():
    a = BlockAllocator(3)
    blocks = a.allocate_many(3)
    assert blocks == [0, 1, 2] and a.num_free == 0
    with pytest.raises(EngineError, match="KV cache has 0 free blocks, 1 needed"):
        a.allocate_many(1)
    a.release(1)
    assert a.num_free == 1 and a.allocate() == 1
    with pytest.raises(AssertionError):
        a.release_all([0, 0])


def test_cached_blocks_are_shared_with_refcounts():
    a = BlockAllocator(4)
    toks = [[1, 2], [3, 4]]
    keys = hash_blocks([1, 2, 3, 4], 2, ("m",))
    b0, b1 = a.allocate_many(2)
    assert a.register(b0, keys[0], toks[0]) == b0 and a.register(b1, keys[1], toks[1]) == b1
    assert a.match_prefix(keys, toks) == [b0, b1]
    for b in (b0, b1):
        a.acquire(b)
    assert a.refcount(b0) == 2
    a.release_all([b0, b1])
    a.release_all([b0, b1])
    assert a.num_free == 4 and a.num_cached == 2
    # cached-but-free blocks are still found, and acquiring takes them off the free list
    assert a.match_prefix(keys, toks) == [b0, b1]
    a.acquire(b0)
    assert a.num_free == 3 and a.refcount(b0) == 1


def test_lru_reuse_prefers_uncached_then_oldest_cached():
    a = BlockAllocator(3)
    k = [BlockHash(10), BlockHash(11)]
    b0, b1, b2 = a.allocate_many(3)
    a.register(b0, k[0], [0])
    a.register(b1, k[1], [1])
    a.release(b0)  # cached, freed first (oldest)
    a.release(b1)  # cached
    a.release(b2)  # uncached → reused first
    assert a.allocate() == b2
    assert a.allocate() == b0 and a.lookup(k[0], [0]) is None and a.stats.evictions == 1
    assert a.lookup(k[1], [1]) == b1


def test_hash_collision_is_detected_by_tokens():
    a = BlockAllocator(2)
    key = BlockHash(42)
    b0 = a.allocate()
    a.register(b0, key, [1, 2, 3])
    assert a.lookup(key, [1, 2, 3]) == b0
    assert a.match_prefix([key], [[9, 9, 9]]) == []
    assert a.stats.collisions == 1
    b1 = a.allocate()
    assert a.register(b1, key, [7, 7, 7]) == b0  # the colliding block is not cached
    assert a.stats.collisions == 2 and a.key_of(b1) is None


def test_prefix_cache_off_never_matches():
    a = BlockAllocator(2, enable_prefix_cache=False)
    b = a.allocate()
    keys = hash_blocks([1, 2], 2)
    a.register(b, keys[0], [1, 2])
    assert a.match_prefix(keys, [[1, 2]]) == [] and a.num_cached == 0
