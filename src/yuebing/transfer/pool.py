"""`SieveCache`: a capacity-capped map with SIEVE eviction (Zhang et al., NSDI'24), used by the
engine as its endpoint pool as in the Mooncake paper.

Entries sit in a queue, newest at the head; a hit only sets the entry's ``visited`` bit. To
make room, a hand walks from the tail toward the head: a visited entry gets its bit cleared and
survives, the first unvisited (and evictable) entry is evicted; the hand stays where it stopped
for the next eviction and wraps from the head back to the tail. Entries the ``evictable``
predicate refuses (endpoints with transfers in flight) are skipped; if none can go, the cache
stays over capacity until one can.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class SieveCache(Generic[K, V]):
    """Thread-safe SIEVE cache. ``on_evict(key, value)`` runs outside the lock after eviction."""

    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None,
                 evictable: Callable[[V], bool] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._on_evict = on_evict
        self._evictable = evictable or (lambda v: True)
        self._lock = threading.Lock()
        self._values: dict[K, V] = {}
        self._visited: dict[K, bool] = {}
        self._queue: list[K] = []  # index 0 = tail (oldest), -1 = head (newest)
        self._hand = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def keys(self) -> list[K]:
        """Keys from tail (oldest) to head (newest)."""
        with self._lock:
            return list(self._queue)

    def get(self, key: K) -> V | None:
        with self._lock:
            v = self._values.get(key)
            if v is not None:
                self._visited[key] = True
            return v

    def get_or_create(self, key: K, factory: Callable[[], V]) -> V:
        """The cached value, or ``factory()`` inserted at the head (evicting if full).

        ``factory`` runs outside the lock (it may connect to a peer); if two threads race, the
        first inserted value wins and the loser's value is passed to ``on_evict``."""
        v = self.get(key)
        if v is not None:
            return v
        created = factory()
        evicted: list[tuple[K, V]] = []
        with self._lock:
            existing = self._values.get(key)
            if existing is not None:
                self._visited[key] = True
                evicted.append((key, created))
                created = existing
            else:
                while len(self._values) >= self.capacity:
                    victim = self._evict_one()
                    if victim is None:
                        break
                    evicted.append(victim)
                self._values[key] = created
                self._visited[key] = False
                self._queue.append(key)
        for k, old in evicted:
            if self._on_evict is not None:
                self._on_evict(k, old)
        return created

    def _evict_one(self) -> tuple[K, V] | None:
        n = len(self._queue)
        for _ in range(2 * n + 1):  # one pass clears bits, the next finds a victim
            if self._hand >= len(self._queue):
                self._hand = 0
            key = self._queue[self._hand]
            if self._visited[key] or not self._evictable(self._values[key]):
                self._visited[key] = False
                self._hand += 1
                continue
            del self._queue[self._hand]
            del self._visited[key]
            self.evictions += 1
            return key, self._values.pop(key)
        return None

    def pop(self, key: K) -> V | None:
        """Remove ``key`` without calling ``on_evict``; returns its value."""
        with self._lock:
            v = self._values.pop(key, None)
            if v is not None:
                i = self._queue.index(key)
                del self._queue[i]
                del self._visited[key]
                if i < self._hand:
                    self._hand -= 1
            return v

    def drain(self) -> list[tuple[K, V]]:
        """Remove and return every entry (for shutdown)."""
        with self._lock:
            items = [(k, self._values[k]) for k in self._queue]
            self._values.clear()
            self._visited.clear()
            self._queue.clear()
            self._hand = 0
            return items
