"""The simulated global KV pool: one LRU block cache per node plus a global index.

At routing the Conductor asks for each prefill node's longest cached prefix
(`GlobalKVPool.prefix_lengths`); the chosen node touches what it reuses (`touch`), copies a
longer prefix when the policy says so (`insert`: a replica of hot blocks), and stores all the
request's blocks when its prefill ends. Nodes evict least-recently-used blocks over capacity;
the index (block → bitmask of holders) follows. As in ``yuebing trace hit-rate``, a request
reuses its longest run of *leading* resident blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from yuebing.core.errors import InputError


class GlobalKVPool:
    """``nodes`` LRU pools of ``capacity_blocks`` blocks each, with a block → holders index."""

    __slots__ = ("nodes", "capacity_blocks", "_pools", "_holders", "evictions", "hits")

    def __init__(self, nodes: int, capacity_blocks: int) -> None:
        if not 1 <= nodes <= 1024:
            raise InputError(f"KV pool needs 1..1024 nodes, got {nodes}")
        if capacity_blocks < 1:
            raise InputError(f"KV pool capacity must be >= 1 block, got {capacity_blocks}")
        self.nodes = nodes
        self.capacity_blocks = capacity_blocks
        self._pools: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(nodes)]
        self._holders: dict[int, int] = {}
        """block → bitmask of the nodes holding it."""
        self.evictions = 0
        self.hits: dict[int, int] = {}
        """block → times it was reused by a request (for the hot-key report)."""

    def used_blocks(self, node: int) -> int:
        return len(self._pools[node])

    def holders(self, block: int) -> int:
        """Bitmask of nodes holding ``block`` (0: nowhere)."""
        return self._holders.get(block, 0)

    def replicas(self, block: int) -> int:
        return self._holders.get(block, 0).bit_count()

    def prefix_lengths(self, keys: Sequence[int]) -> tuple[list[int], int, int]:
        """(leading blocks held by each node, longest such run, lowest node holding it).

        The holder is -1 when no node holds the first block.
        """
        lengths = [0] * self.nodes
        holders = self._holders
        alive = (1 << self.nodes) - 1
        j = 0
        last_alive = 0
        for j, key in enumerate(keys):  # noqa: B007 - j is used after the loop
            now = alive & holders.get(key, 0)
            if now != alive:
                gone = alive & ~now
                while gone:
                    low = gone & -gone
                    lengths[low.bit_length() - 1] = j
                    gone ^= low
                if not now:
                    break
                alive = now
            last_alive = alive
        else:
            j = len(keys)
            while alive:
                low = alive & -alive
                lengths[low.bit_length() - 1] = j
                alive ^= low
        best = max(lengths) if keys else 0
        if best == 0:
            return lengths, 0, -1
        holder = (last_alive & -last_alive).bit_length() - 1
        return lengths, best, holder

    def touch(self, node: int, keys: Sequence[int]) -> None:
        """Refresh the blocks of ``keys`` this node holds (last to first); count reuse."""
        pool = self._pools[node]
        hits = self.hits
        for key in reversed(keys):
            if key in pool:
                pool.move_to_end(key)
                hits[key] = hits.get(key, 0) + 1

    def insert(self, node: int, keys: Sequence[int]) -> None:
        """Store/refresh ``keys`` on ``node`` from last to first, then evict down to capacity."""
        pool = self._pools[node]
        holders = self._holders
        bit = 1 << node
        for key in reversed(keys):
            if key in pool:
                pool.move_to_end(key)
            else:
                pool[key] = None
                holders[key] = holders.get(key, 0) | bit
        excess = len(pool) - self.capacity_blocks
        for _ in range(excess if excess > 0 else 0):
            old, _ = pool.popitem(last=False)
            mask = holders[old] & ~bit
            if mask:
                holders[old] = mask
            else:
                del holders[old]
            self.evictions += 1

    def hot_blocks(self, top: int) -> list[int]:
        """The ``top`` most reused blocks (ties: smaller key first)."""
        return sorted(self.hits, key=lambda k: (-self.hits[k], k))[:top]
