"""`Spinner`: bounded, adaptive busy-polling before a blocking wait; `GapPredictor`: whether a
server should spin for its next request.

In `core` because two packages use it, each from its own thread just before it would block:
the inline TCP path (`transfer.transport.tcp_inline`) and the store's RPC framing (`store.wire`,
client and master). On a virtual machine without guest halt-polling, waking a sleeping process
costs ~20 µs — more than the master's work per call; polling a short window avoids it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

LOST_S = 500e-6
"""A yield this long means another task had the CPU (a peer's answer takes microseconds)."""
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0


class Spinner:
    """Per-thread spin state (not thread-safe: one per connection / serving loop).

    Between polls the thread yields (``sched_yield``) so a peer on the same CPU runs first. On a
    contended CPU a yield can hand the CPU away for a whole time slice, so a yield longer than
    `LOST_S` without the event turns spinning off for a back-off that doubles per loss up to
    `MAX_BACKOFF_S` and halves per spin that catches its event (at most one lost slice a second on
    a busy machine); the caller then blocks as usual."""

    __slots__ = ("_backoff", "_off_until", "lost")

    def __init__(self) -> None:
        self._off_until = 0.0
        self._backoff = BACKOFF_S
        self.lost = 0
        """Times spinning was turned off because the CPU was lost (for tests and stats)."""

    @property
    def enabled(self) -> bool:
        return time.perf_counter() >= self._off_until

    def wait(self, poll: Callable[[], T], window_s: float) -> T:
        """Call ``poll`` (non-blocking) until it returns something truthy or ``window_s`` has
        passed, yielding the CPU between calls; returns its last result. While backed off,
        or with ``window_s <= 0``, it polls exactly once."""
        got = poll()
        if got or window_s <= 0:
            return got
        now = time.perf_counter()
        if now < self._off_until:
            return got
        stop = now + window_s
        while now < stop:
            os.sched_yield()  # a peer runnable on this CPU runs first
            after = time.perf_counter()
            got = poll()
            if got:
                self._backoff = max(BACKOFF_S, self._backoff / 2)  # spinning pays again
                return got
            if after - now > LOST_S:  # the CPU went to other work: stop spinning for a while
                self.lost += 1
                self._off_until = after + self._backoff
                self._backoff = min(2 * self._backoff, MAX_BACKOFF_S)
                return got
            now = after
        return got


class GapPredictor:
    """Whether the next request is likely to arrive within ``window_s``: an exponentially
    weighted mean of the gaps between arrivals (each gap capped at 4 windows, so one idle period
    does not disable spinning for long). Called by a serving loop once per arrival.

    A server that spins after every request (the store master) spins only while requests have
    recently arrived within the window, so a trickle further apart (heartbeats) costs no spinning."""

    __slots__ = ("_last", "alpha", "mean", "window_s")

    def __init__(self, window_s: float, alpha: float = 0.25) -> None:
        self.window_s = window_s
        self.alpha = alpha
        self.mean = 0.0
        """Mean gap between arrivals (seconds), starting optimistic."""
        self._last: float | None = None

    def arrived(self, now: float) -> float:
        """Record an arrival at ``now``; returns until when to spin for the next one (0: do
        not spin — arrivals have been further apart than the window)."""
        if self._last is not None:
            gap = min(now - self._last, 4 * self.window_s)
            self.mean += self.alpha * (gap - self.mean)
        self._last = now
        return now + self.window_s if self.mean <= self.window_s else 0.0
