"""KV block allocator with a local prefix cache: `BlockAllocator`.

The scheduler calls it when it admits, extends, preempts, finishes or aborts a sequence:
`match_prefix` finds the longest run of cached blocks holding exactly the given tokens (keys
from `yuebing.core.hashing.hash_block`; a key hit whose stored tokens differ is a collision and
ends the match), which the caller then `acquire`s; `allocate` hands out never-used blocks
first, then the least recently freed cached block (dropping its key); `register` publishes a
full block; a `release`d block at zero references stays findable by its key until reused.
Pure Python and single-threaded (the engine loop owns it); no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from yuebing.core.errors import EngineError
from yuebing.core.ids import BlockHash


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    collisions: int = 0
    evictions: int = 0


class BlockAllocator:
    """Refcounted fixed-size KV blocks ``0 .. num_blocks-1``."""

    def __init__(self, num_blocks: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks <= 0:
            raise EngineError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_cache = enable_prefix_cache
        self._refs = [0] * num_blocks
        self._key: list[BlockHash | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.stats = PrefixCacheStats()

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out (unused plus evictable cached ones)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def key_of(self, block: int) -> BlockHash | None:
        return self._key[block]

    def allocate(self) -> int:
        """A block with refcount 1; `EngineError` when none is free (the caller preempts)."""
        if not self._free:
            raise EngineError("KV cache is full")
        block, _ = self._free.popitem(last=False)
        key = self._key[block]
        if key is not None:
            del self._cached[key]
            self._key[block] = None
            self._tokens[block] = None
            self.stats.evictions += 1
        self._refs[block] = 1
        return block

    def allocate_many(self, n: int) -> list[int]:
        """``n`` blocks or none at all."""
        if n > len(self._free):
            raise EngineError(f"KV cache has {len(self._free)} free blocks, {n} needed")
        return [self.allocate() for _ in range(n)]

    def acquire(self, block: int) -> None:
        """One more reference to a cached block (taking it off the free list if it was free)."""
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1

    def release(self, block: int) -> None:
        """Drop a reference; a block at zero references becomes free (most recently used)."""
        if self._refs[block] <= 0:
            raise AssertionError(f"block {block} released more often than acquired")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            if self._key[block] is None:
                self._free[block] = None
                self._free.move_to_end(block, last=False)  # uncached blocks are reused first
            else:
                self._free[block] = None

    def release_all(self, blocks: Sequence[int]) -> None:
        # free the tail first so the prefix (most shareable) stays cached longest
        for b in reversed(blocks):
            self.release(b)

    def register(self, block: int, key: BlockHash, tokens: Sequence[int]) -> int:
        """Publish a full block under ``key``; returns the block now holding that key.

        If another block already holds ``key`` with the same tokens that block stays the
        cached one (this block remains private); a different token content is a collision and
        is not cached.
        """
        if not self.enable_prefix_cache:
            return block
        existing = self._cached.get(key)
        if existing is not None:
            if self._tokens[existing] != tuple(tokens):
                self.stats.collisions += 1
            return existing
        if self._key[block] is not None:
            return block
        self._cached[key] = block
        self._key[block] = key
        self._tokens[block] = tuple(tokens)
        return block

    def lookup(self, key: BlockHash, tokens: Sequence[int]) -> int | None:
        """The cached block for ``key`` holding exactly ``tokens``, else None."""
        block = self._cached.get(key)
        if block is None:
            return None
        if self._tokens[block] != tuple(tokens):
            self.stats.collisions += 1
            return None
        return block

    def is_cached(self, key: BlockHash) -> bool:
        """Whether a block with ``key`` is in the prefix cache (no statistics counted)."""
        return key in self._cached

    def match_prefix(self, keys: Sequence[BlockHash],
                     token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Longest run of cached blocks for the chained ``keys`` (not yet acquired)."""
        if not self.enable_prefix_cache:
            return []
        found: list[int] = []
        for key, tokens in zip(keys, token_blocks, strict=True):
            self.stats.queried_blocks += 1
            block = self.lookup(key, tokens)
            if block is None:
                break
            found.append(block)
        self.stats.hit_blocks += len(found)
        return found

    def cached_keys(self) -> list[BlockHash]:
        """Keys of every block findable in the prefix cache (for instance reports)."""
        return list(self._cached)
