"""Exact hit-rate semantics of yuebing.trace.hitrate on hand-built traces."""

from __future__ import annotations

import math

import numpy as np
import pytest

from yuebing.core.errors import ConfigError
from yuebing.trace.hitrate import (
    PrefixLRU,
    blocks_for,
    capacity_key,
    hit_rate_curve,
    simulate_global,
    simulate_local,
)
from yuebing.trace.model import Request, Trace


def req(ts: int, n: int, ids: tuple[int, ...]) -> Request:
    return Request(ts, n, 1, ids)


def tr(*rs: Request) -> Trace:
    return Trace(tuple(rs))


def test_refresh_matched_prefix_before_inserting_suffix() -> None:
    # Cache of 3 blocks holds [1, 2, 3] (LRU first). Request (1, 4, 5) reuses block 1; block 1
    # is refreshed first, so inserting 5 evicts 2 and inserting 4 evicts 3 — never block 1.
    # (The end state equals the recency order of the touches either way; see hitrate docs.)
    cache = PrefixLRU(3)
    for ids in ((1,), (2,), (3,)):
        cache.access(ids, cache.match(ids))
    assert cache.order() == [1, 2, 3]
    assert cache.match((1, 4, 5)) == 1
    cache.access((1, 4, 5), 1)
    assert cache.order() == [5, 4, 1]  # prefix more recent than its suffix


def test_without_match_suffix_inserted_last_to_first_evicts_lru() -> None:
    cache = PrefixLRU(2)
    cache.access((7, 8, 9), 0)  # 9 in, 8 in, 7 in → 9 evicted
    assert cache.order() == [8, 7]
    cache.access((1,), 0)
    assert cache.order() == [7, 1]


def test_request_longer_than_cache_keeps_its_prefix() -> None:
    # last-to-first insertion into 2 blocks leaves (1, 2), so the next (1, 2, 9) reuses both;
    # first-to-last insertion would leave (2, 3) and reuse nothing
    t = tr(req(0, 1536, (1, 2, 3)), req(1, 1536, (1, 2, 9)))
    r = simulate_global(t, 1024)
    assert r.hit_tokens == 1024


def test_leading_run_only() -> None:
    cache = PrefixLRU(10)
    cache.access((1, 2), 0)
    assert cache.match((9, 1, 2)) == 0
    assert cache.match((1, 3, 2)) == 1
    assert cache.match((1, 2, 3)) == 2


def test_global_hit_tokens_partial_last_block_and_min() -> None:
    t = tr(req(0, 512, (1,)), req(1, 512, (2,)), req(2, 512, (3,)),
           req(3, 1500, (1, 4, 5)),   # m=1 → 512 hit tokens
           req(4, 1400, (1, 4, 5)))   # m=3 → min(1536, 1400) = 1400
    r = simulate_global(t, 3 * 512)
    assert r.capacity_blocks_per_cache == 3
    assert r.input_tokens == 3 * 512 + 1500 + 1400
    assert r.hit_tokens == 512 + 1400
    assert r.hit_rate == (512 + 1400) / (3 * 512 + 1500 + 1400)


def test_eviction_order_decides_hits() -> None:
    # capacity 2 blocks: after (1,),(2,),(3,) block 1 is gone, 2 and 3 remain
    t = tr(req(0, 512, (1,)), req(1, 512, (2,)), req(2, 512, (3,)),
           req(3, 512, (2,)), req(4, 512, (1,)), req(5, 512, (3,)))
    r = simulate_global(t, 1024 + 511)  # floor → 2 blocks
    # (2,) hits → [3,2]; (1,) misses, evicts 3 → [2,1]; (3,) misses
    assert r.hit_tokens == 512
    assert r.hit_rate == 512 / (6 * 512)


def test_timestamp_order_is_stable_and_not_file_order() -> None:
    a = req(10, 100, (1,))
    b = req(0, 1024, (1, 2))
    # time order b, a: b misses, a hits min(512, 100) = 100
    assert simulate_global(tr(a, b), 10_000).hit_tokens == 100
    # equal timestamps keep file order: a first (miss), then b hits 512
    assert simulate_global(tr(req(5, 100, (1,)), req(5, 1024, (1, 2))), 10_000).hit_tokens == 512
    assert simulate_global(tr(req(5, 1024, (1, 2)), req(5, 100, (1,))), 10_000).hit_tokens == 100


def test_zero_and_unbounded_capacity() -> None:
    t = tr(*(req(i, 512 * (1 + i % 2), (1, 2)[: 1 + i % 2]) for i in range(6)))
    assert simulate_global(t, 511).hit_tokens == 0
    unbounded = simulate_global(t, math.inf)
    assert unbounded.capacity_blocks_per_cache == math.inf
    # (1,) misses; then (1,2)→512, (1,)→512, (1,2)→1024, (1,)→512, (1,2)→1024
    assert unbounded.hit_tokens == 512 + 512 + 1024 + 512 + 1024
    assert unbounded.input_tokens == 3 * 512 + 3 * 1024


def test_capacity_helpers() -> None:
    assert blocks_for(1023, 512) == 1
    assert blocks_for(1024, 512) == 2
    assert blocks_for(math.inf, 512) == math.inf
    assert capacity_key(1e6) == "1000000"
    assert capacity_key(math.inf) == "inf"
    with pytest.raises(ConfigError, match="capacity must be >= 0"):
        blocks_for(-1, 512)


def same_prefix_trace() -> Trace:
    return tr(*(req(i, 512, (1,)) for i in range(4)))


def test_round_robin_local() -> None:
    r = simulate_local(same_prefix_trace(), 2048, 2, "round_robin")
    assert r.capacity_blocks_per_cache == 2
    assert r.loads == [2, 2]
    assert r.hit_tokens == 1024  # c0 miss, c1 miss, c0 hit, c1 hit


def test_cache_aware_prefers_longest_prefix() -> None:
    r = simulate_local(same_prefix_trace(), 2048, 2, "cache_aware")
    assert r.loads == [4, 0]
    assert r.hit_tokens == 3 * 512


def test_cache_aware_ties_go_to_least_loaded_then_lowest_index() -> None:
    t = tr(req(0, 512, (1,)), req(1, 512, (2,)), req(2, 512, (3,)), req(3, 512, (2,)))
    r = simulate_local(t, 4096, 2, "cache_aware")
    # (1,)→c0 (tie, idx), (2,)→c1 (less loaded), (3,)→c0 (tie on load 1/1, idx), (2,)→c1 hit
    assert r.loads == [2, 2]
    assert r.hit_tokens == 512


def test_random_routing_is_seeded_numpy() -> None:
    t = tr(*(req(i, 512, (i % 3,)) for i in range(50)))
    r1 = simulate_local(t, 10 * 512, 4, "random", seed=7)
    r2 = simulate_local(t, 10 * 512, 4, "random", seed=7)
    assert r1 == r2
    draws = np.random.default_rng(7).integers(4, size=50)
    assert r1.loads == [int((draws == k).sum()) for k in range(4)]


def test_local_capacity_is_split_and_validated() -> None:
    assert simulate_local(same_prefix_trace(), 2047, 2, "round_robin").capacity_blocks_per_cache == 1
    with pytest.raises(ConfigError, match="unknown routing rule 'nearest'"):
        simulate_local(same_prefix_trace(), 2048, 2, "nearest")
    with pytest.raises(ConfigError, match="local caches must be >= 1"):
        simulate_local(same_prefix_trace(), 2048, 0)


def test_one_local_cache_equals_global() -> None:
    t = tr(req(0, 512, (1,)), req(1, 900, (1, 2)), req(2, 512, (3,)), req(3, 1000, (1, 2)))
    for cap in (512, 1024, 4096):
        g = simulate_global(t, cap)
        for routing in ("round_robin", "random", "cache_aware"):
            assert simulate_local(t, cap, 1, routing).hit_tokens == g.hit_tokens


def test_curve() -> None:
    t = same_prefix_trace()
    assert [r.hit_tokens for r in hit_rate_curve(t, [0, 512])] == [0, 1536]
    with pytest.raises(ConfigError, match="routing 'global' means one cache"):
        hit_rate_curve(t, [512], caches=2)
