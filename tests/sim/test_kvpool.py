"""Global KV pool: leading-prefix lookup, LRU order, index and replica counts."""

from __future__ import annotations

import pytest

from yuebing.core.errors import InputError
from yuebing.sim.kvpool import GlobalKVPool


def test_prefix_lengths_per_node_and_best_holder() -> None:
    pool = GlobalKVPool(nodes=3, capacity_blocks=10)
    pool.insert(0, [1, 2])
    pool.insert(1, [1, 2, 3, 4])
    pool.insert(2, [9, 2, 3])          # holds 2 and 3 but not the leading block 1
    lengths, best, holder = pool.prefix_lengths([1, 2, 3, 4, 5])
    assert lengths == [2, 4, 0]
    assert (best, holder) == (4, 1)
    assert pool.prefix_lengths([7, 8]) == ([0, 0, 0], 0, -1)
    assert pool.prefix_lengths([]) == ([0, 0, 0], 0, -1)
    # the whole request cached on two nodes: the lowest-numbered one is reported
    pool.insert(2, [1, 2])
    assert pool.prefix_lengths([1, 2]) == ([2, 2, 2], 2, 0)


def test_lru_evicts_suffix_before_prefix_and_updates_index() -> None:
    pool = GlobalKVPool(nodes=2, capacity_blocks=3)
    pool.insert(0, [1, 2, 3])          # inserted last-to-first: 1 is most recent, 3 least
    pool.insert(1, [3])
    assert pool.replicas(3) == 2
    pool.insert(0, [4])                # evicts 3 from node 0
    assert pool.used_blocks(0) == 3 and pool.evictions == 1
    assert pool.holders(3) == 0b10 and pool.replicas(3) == 1
    pool.touch(0, [2])                 # 2 becomes most recent; 1 is now the LRU
    pool.insert(0, [5])
    assert pool.holders(1) == 0 and pool.replicas(2) == 1
    assert pool.prefix_lengths([2, 4, 1])[0] == [2, 0]   # 1 was evicted


def test_touch_counts_reuse_for_hot_blocks() -> None:
    pool = GlobalKVPool(nodes=1, capacity_blocks=8)
    pool.insert(0, [1, 2, 3])
    pool.touch(0, [1, 2])
    pool.touch(0, [1])
    pool.touch(0, [7])                 # not held: no count
    assert pool.hot_blocks(5) == [1, 2]
    assert pool.hits == {1: 2, 2: 1}


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(InputError):
        GlobalKVPool(nodes=0, capacity_blocks=1)
    with pytest.raises(InputError):
        GlobalKVPool(nodes=1, capacity_blocks=0)


def test_hot_prefixes_pick_one_block_per_shared_chain() -> None:
    from yuebing.sim.mooncake import hot_prefixes
    from yuebing.sim.workload import SimRequest

    reqs = [SimRequest(0, 0.0, 2048, 2, (0, 1, 2, 3)), SimRequest(1, 1.0, 2048, 2, (0, 1, 2, 4)),
            SimRequest(2, 2.0, 1024, 2, (0, 5)), SimRequest(3, 3.0, 1024, 2, (0, 5))]
    # 0 is in all four; 1 and 2 form one chain used twice; 5 another chain used twice
    assert hot_prefixes(reqs, 3) == [0, 1, 5]
    assert hot_prefixes(reqs, 1) == [0]
