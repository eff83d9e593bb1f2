"""Discrete-event loop of the simulator: one heap, one seed, deterministic.

A system (`sim.system.SimSystem`) and the runner schedule callbacks with `EventLoop.at` /
`EventLoop.after`; `EventLoop.run` pops them in order, advances ``now`` and calls them. Events
fire by time, then `Priority` (``COMPLETE`` before ``ARRIVAL`` before ``SAMPLE``: freed
resources are seen by new requests, settled state by observers), then scheduling order. All
randomness comes from ``loop.rng``, seeded once; nothing reads a wall clock, so equal inputs
and seed give bit-identical results.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from enum import IntEnum
from typing import Any

from yuebing.core.errors import InputError


class Priority(IntEnum):
    """Tie-break class of events scheduled for the same instant (lower fires first)."""

    COMPLETE = 0
    ARRIVAL = 1
    SAMPLE = 2


class EventLoop:
    """A min-heap of ``(time, priority, seq, callback, args)`` entries.

    Called by the simulation runner and by simulated components (from the single simulation
    thread). Callbacks run with ``loop.now`` set to their time; they may schedule events at
    ``now`` or later, never earlier.
    """

    __slots__ = ("_heap", "_seq", "now", "rng", "events")

    def __init__(self, seed: int = 0, start_s: float = 0.0) -> None:
        self._heap: list[tuple[float, int, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.now = float(start_s)
        self.rng = random.Random(seed)
        self.events = 0
        """Number of events fired so far."""

    def at(self, t: float, priority: int, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` at absolute time ``t`` (seconds, ``t >= now``)."""
        if not t >= self.now:  # also NaN, which would corrupt the heap order
            raise InputError(f"cannot schedule an event at {t!r} s before now ({self.now!r} s)")
        self._seq += 1
        heapq.heappush(self._heap, (t, priority, self._seq, fn, args))

    def after(self, delay: float, priority: int, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` ``delay`` seconds from now (``delay >= 0``)."""
        if not delay >= 0:  # also NaN
            raise InputError(f"event delay must be >= 0 s, got {delay!r}")
        self._seq += 1
        heapq.heappush(self._heap, (self.now + delay, priority, self._seq, fn, args))

    def pending(self) -> int:
        """Events scheduled and not yet fired."""
        return len(self._heap)

    def peek_time(self) -> float | None:
        """Time of the next event, or None when the heap is empty."""
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None) -> int:
        """Fire events in order until the heap is empty (or the next one is after ``until``).

        Returns the number of events fired by this call.
        """
        heap = self._heap
        pop = heapq.heappop
        fired = 0
        limit = float("inf") if until is None else until
        while heap and heap[0][0] <= limit:
            t, _prio, _seq, fn, args = pop(heap)
            self.now = t
            fn(*args)
            fired += 1
        self.events += fired
        if until is not None and until > self.now:
            self.now = until
        return fired
