"""Offset allocator of one segment: best-fit over a free list with coalescing.

The master owns one allocator per mounted segment and never touches the segment's bytes. Free
ranges are kept three ways: ``start -> size`` and ``end -> start`` dicts for O(1) coalescing, and
a sorted list of ``(size, start)`` for best-fit lookup by bisection.
"""

from __future__ import annotations

from bisect import bisect_left, insort


class OffsetAllocator:
    """Allocates aligned ``[offset, offset + size)`` ranges inside ``[0, capacity)``."""

    __slots__ = ("_by_end", "_by_size", "_by_start", "alignment", "capacity", "used")

    def __init__(self, capacity: int, alignment: int = 64) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self.used = 0
        self._by_start: dict[int, int] = {}
        self._by_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        if self.capacity:
            self._add_free(0, self.capacity)

    def rounded(self, size: int) -> int:
        """The bytes an allocation of ``size`` really takes."""
        a = self.alignment
        return max(a, (size + a - 1) & ~(a - 1))

    @property
    def free(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return self._by_size[-1][0] if self._by_size else 0

    def free_ranges(self) -> list[tuple[int, int]]:
        """The free ranges as ``(start, size)``, in no particular order (`fit` reads them)."""
        return list(self._by_start.items())

    def alloc(self, size: int) -> int | None:
        """Offset of a new range of ``size`` bytes, or None when no free range fits."""
        n = self.rounded(size)
        i = bisect_left(self._by_size, (n, -1))
        if i == len(self._by_size):
            return None
        fsize, start = self._by_size.pop(i)
        del self._by_start[start]
        del self._by_end[start + fsize]
        if fsize > n:
            self._add_free(start + n, fsize - n)
        self.used += n
        return start

    def free_range(self, offset: int, size: int) -> None:
        """Return a range obtained from `alloc` (same ``size``) or `reserve`."""
        n = self.rounded(size)
        start, end = offset, offset + n
        prev_start = self._by_end.get(start)
        if prev_start is not None:
            self._remove_free(prev_start, start - prev_start)
            start = prev_start
        next_size = self._by_start.get(end)
        if next_size is not None:
            self._remove_free(end, next_size)
            end += next_size
        self._add_free(start, end - start)
        self.used -= n

    def reserve(self, offset: int, size: int) -> bool:
        """Mark a specific range used (rebuilding state after failover); False if not free."""
        n = self.rounded(size)
        for fsize, start in self._by_size:
            if start <= offset and offset + n <= start + fsize:
                self._remove_free(start, fsize)
                if offset > start:
                    self._add_free(start, offset - start)
                if start + fsize > offset + n:
                    self._add_free(offset + n, start + fsize - offset - n)
                self.used += n
                return True
        return False

    @classmethod
    def rebuild(cls, capacity: int, alignment: int, used: list[tuple[int, int]]) -> OffsetAllocator:
        """An allocator whose used ranges are exactly ``used`` [(offset, size)], in O(n log n)."""
        a = cls(capacity, alignment)
        a._by_start.clear()
        a._by_end.clear()
        a._by_size.clear()
        pos = 0
        for off, size in sorted(used):
            n = a.rounded(size)
            if off < pos:
                raise ValueError(f"overlapping ranges at offset {off}")
            if off > pos:
                a._add_free(pos, off - pos)
            pos = off + n
            a.used += n
        if pos < a.capacity:
            a._add_free(pos, a.capacity - pos)
        return a

    def _add_free(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        insort(self._by_size, (size, start))

    def _remove_free(self, start: int, size: int) -> None:
        del self._by_start[start]
        del self._by_end[start + size]
        i = bisect_left(self._by_size, (size, start))
        del self._by_size[i]
