"""Prefix-cache hit rate of a trace vs cache capacity (`yuebing trace hit-rate`, Figure 9).

Requests are replayed in timestamp order through `PrefixLRU` caches: a request reuses the
longest run of its *leading* ``hash_ids`` that are resident (hit tokens min(m · block_size,
input_length)); hit rate = Σ hits / Σ input tokens. "Global" is one cache of C tokens
(`simulate_global`); "local" is N caches of C / N tokens, each request served by one chosen by
a `Router` (`simulate_local`). `PrefixLRU` states the exact update rule, which the tests pin.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

import msgspec
import numpy as np

from yuebing.core.config import require
from yuebing.core.registry import Registry
from yuebing.trace.model import Trace

log = logging.getLogger(__name__)

UNBOUNDED = math.inf
"""Capacity meaning "never evict"."""


class PrefixLRU:
    """An LRU set of block ids with the prefix-reuse semantics above (OrderedDict, MRU last).

    Exact semantics (pinned by tests/trace/test_trace_hitrate.py and test_trace_hitrate_props.py):
    equal timestamps keep file order; a cache of C tokens holds floor(C / block_size) blocks; after
    matching, the m matched blocks are refreshed (last to first), then all the request's blocks are
    inserted or touched from last to first, evicting the least recently used block whenever the
    cache is over capacity — so a prefix is always more recent than its suffix and a reused prefix
    is never evicted for its own suffix. (An LRU's contents are the most recent distinct blocks of
    its touch sequence, so the refresh changes transient states only, never a result.)"""

    def __init__(self, capacity_blocks: float) -> None:
        if not capacity_blocks >= 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def order(self) -> list[int]:
        """Resident blocks from least to most recently used."""
        return list(self._blocks)

    def match(self, hash_ids: Sequence[int]) -> int:
        """Number of leading ``hash_ids`` resident (no side effects)."""
        blocks = self._blocks
        m = 0
        for h in hash_ids:
            if h not in blocks:
                break
            m += 1
        return m

    def access(self, hash_ids: Sequence[int], matched: int) -> None:
        """Refresh the ``matched`` prefix, then insert/touch all blocks from last to first."""
        blocks = self._blocks
        move = blocks.move_to_end
        for i in range(matched - 1, -1, -1):
            move(hash_ids[i])
        if self.capacity_blocks == 0:
            return
        cap = self.capacity_blocks
        for i in range(len(hash_ids) - 1, -1, -1):
            h = hash_ids[i]
            if h in blocks:
                move(h)
            else:
                blocks[h] = None
                if len(blocks) > cap:
                    blocks.popitem(last=False)


class Router(ABC):
    """Chooses which local cache serves a request.

    Called by `simulate_local` once per request, in replay order, with the match length the
    request would get on each cache and each cache's load (requests routed to it so far).
    Must be deterministic given its constructor arguments; no side effects beyond its state.
    """

    def __init__(self, n: int, seed: int = 0) -> None:
        """``n`` caches to choose from; ``seed`` (>= 0) for rules that draw random numbers."""
        require(n >= 1, f"need at least one cache to route to, got {n}")
        require(seed >= 0, f"seed must be >= 0, got {seed}")
        self.n = n

    @abstractmethod
    def choose(self, matches: Sequence[int], loads: Sequence[int]) -> int:
        """Index of the cache to use."""

    needs_matches: bool = True
    """Whether `choose` reads ``matches`` (lets the simulator skip computing them)."""


ROUTERS: Registry[type[Router]] = Registry("routing rule")


@ROUTERS.register("round_robin")
class RoundRobinRouter(Router):
    """Request k (in replay order) goes to cache k mod N."""

    needs_matches = False

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n, seed)
        self._next = 0

    def choose(self, matches: Sequence[int], loads: Sequence[int]) -> int:
        i = self._next
        self._next = (i + 1) % self.n
        return i


@ROUTERS.register("random")
class RandomRouter(Router):
    """Uniform choice from ``numpy.random.default_rng(seed)``, one draw per request."""

    needs_matches = False

    def __init__(self, n: int, seed: int = 0) -> None:
        super().__init__(n, seed)
        self._rng = np.random.default_rng(seed)

    def choose(self, matches: Sequence[int], loads: Sequence[int]) -> int:
        return int(self._rng.integers(self.n))


@ROUTERS.register("cache_aware")
class CacheAwareRouter(Router):
    """The cache with the longest prefix; ties go to the least loaded, then the lowest index."""

    def choose(self, matches: Sequence[int], loads: Sequence[int]) -> int:
        return min(range(self.n), key=lambda i: (-matches[i], loads[i], i))


class HitRateResult(msgspec.Struct, frozen=True):
    """Outcome of one replay."""

    capacity_tokens: float
    """Total capacity (all caches together); ``inf`` when unbounded."""
    capacity_blocks_per_cache: float
    caches: int
    routing: str
    requests: int
    input_tokens: int
    hit_tokens: int
    hit_rate: float
    loads: list[int]
    """Requests served by each cache."""


def blocks_for(capacity_tokens: float, block_size: int) -> float:
    """floor(capacity / block_size), or ``inf`` for an unbounded cache."""
    require(capacity_tokens >= 0, f"capacity must be >= 0 tokens, got {capacity_tokens}")
    return UNBOUNDED if math.isinf(capacity_tokens) else float(capacity_tokens // block_size)


def simulate_global(trace: Trace, capacity_tokens: float) -> HitRateResult:
    """Replay ``trace`` through one LRU cache of ``capacity_tokens`` tokens."""
    cache = PrefixLRU(blocks_for(capacity_tokens, trace.block_size))
    bs = trace.block_size
    hit = total = 0
    for r in trace.in_time_order():
        ids = r.hash_ids
        m = cache.match(ids)
        hit += min(m * bs, r.input_length)
        total += r.input_length
        cache.access(ids, m)
    log.debug("global cache of %s tokens: %d / %d tokens hit", capacity_tokens, hit, total)
    return HitRateResult(capacity_tokens, cache.capacity_blocks, 1, "global", len(trace),
                         total, hit, hit / total if total else 0.0, [len(trace)])


def simulate_local(trace: Trace, capacity_tokens: float, caches: int,
                   routing: str = "cache_aware", seed: int = 0) -> HitRateResult:
    """Replay through ``caches`` LRU caches of floor(capacity / caches) tokens each."""
    require(caches >= 1, f"number of local caches must be >= 1, got {caches}")
    router = ROUTERS.get(routing)(caches, seed)
    per_cache = capacity_tokens if math.isinf(capacity_tokens) else capacity_tokens // caches
    lrus = [PrefixLRU(blocks_for(per_cache, trace.block_size)) for _ in range(caches)]
    loads = [0] * caches
    bs = trace.block_size
    hit = total = 0
    zeros = [0] * caches
    for r in trace.in_time_order():
        ids = r.hash_ids
        matches = [c.match(ids) for c in lrus] if router.needs_matches else zeros
        k = router.choose(matches, loads)
        m = matches[k] if router.needs_matches else lrus[k].match(ids)
        hit += min(m * bs, r.input_length)
        total += r.input_length
        lrus[k].access(ids, m)
        loads[k] += 1
    log.debug("%d local caches (%s), %s tokens in all: %d / %d tokens hit, loads %s",
              caches, routing, capacity_tokens, hit, total, loads)
    return HitRateResult(capacity_tokens, lrus[0].capacity_blocks, caches, routing, len(trace),
                         total, hit, hit / total if total else 0.0, loads)


def hit_rate_curve(trace: Trace, capacities: Sequence[float], caches: int = 1,
                   routing: str = "global", seed: int = 0) -> list[HitRateResult]:
    """One result per capacity; ``caches == 1`` with routing "global" is the global cache."""
    if routing == "global":
        require(caches == 1, "routing 'global' means one cache; pick a routing rule for N > 1")
        return [simulate_global(trace, c) for c in capacities]
    return [simulate_local(trace, c, caches, routing, seed) for c in capacities]


def capacity_key(capacity_tokens: float) -> str:
    """JSON key of a capacity: the integer as a string, or ``"inf"``."""
    return "inf" if math.isinf(capacity_tokens) else str(int(capacity_tokens))
