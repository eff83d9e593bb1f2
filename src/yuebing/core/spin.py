"""`Spinner`: bounded, adaptive busy-polling before a blocking wait; `GapPredictor`: whether a
server should spin for its next request.

In `core` because two packages use it, each from its own thread just before it would block:
the inline TCP path (`transfer.transport.tcp_inline`) and the store's RPC framing (`store.wire`,
client and master). On a virtual machine without guest halt-polling, waking a sleeping process
costs ~20 µs — more than the master's work per call; polling a short window avoids it. How long
to spin is chosen per machine (`window_s`, `machine`): a window of -1 ("auto") is the role's
reference window scaled by this machine's measured per-core speed and wake-up cost (measured
once per process), and no spinning where it cannot pay (one CPU, or cheap wake-ups).
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

LOST_S = 500e-6
"""A yield this long means another task had the CPU (a peer's answer takes microseconds)."""
BACKOFF_S = 0.05
MAX_BACKOFF_S = 1.0
CATCHES_TO_HALVE = 64
"""Spins that catch their event before the back-off halves: a lost slice costs milliseconds,
a caught event saves one wake-up (~10-20 µs), so one catch must not undo a loss."""


class Spinner:
    """Per-thread spin state (not thread-safe: one per connection / serving loop).

    Between polls the thread yields (``sched_yield``) so a peer on the same CPU runs first. On a
    contended CPU a yield can hand the CPU away for a whole time slice, so a yield longer than
    `LOST_S` without the event turns spinning off for a back-off that doubles per loss up to
    `MAX_BACKOFF_S` and halves per `CATCHES_TO_HALVE` spins that catch their event (a busy
    machine settles near one lost slice a second; halving per catch let a 2-core VM at load 8
    lose a slice every few calls, ~60 a second); the caller then blocks as usual."""

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
            if got:  # spinning pays again, slowly: one catch saves far less than a loss costs
                self._backoff = max(BACKOFF_S, self._backoff * 0.5 ** (1 / CATCHES_TO_HALVE))
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


AUTO = -1
"""A configured spin window of -1 microseconds: chosen for this machine (`window_s`)."""
REF_STEP_US = 180.0
"""`_step_us` on the machine whose windows are the roles' reference windows (the Intel Xeon
AVX-512/AMX 2-core VM of docs/benchmarks.md, 2026-11-28, where the windows are the former
fixed defaults)."""
REF_WAKE_US = 20.0
"""A VM's cross-CPU wake-up, assumed where it cannot be measured."""
CHEAP_WAKE_US = 2.0
"""Below this measured wake-up cost blocking costs about what a poll does: no spinning."""


@dataclass(frozen=True)
class Machine:
    """What the spin windows are chosen from, measured on this machine (`machine`)."""

    cpus: int
    """CPUs this process may run on."""
    wake_us: float
    """Cost of one wake-up from a blocking wait (median of a thread ping-pong)."""
    step_us: float
    """Time of the reference Python loop (median): the per-core speed."""

    def window_us(self, reference_us: float) -> int:
        """A spin window for this machine, given the role's window on the reference machine."""
        if self.cpus < 2 or self.wake_us < CHEAP_WAKE_US:
            return 0
        scale = min(4.0, max(0.25, self.step_us / REF_STEP_US))
        return int(reference_us * scale)


def _wake_us(cpus: list[int], trips: int = 200) -> float:
    """One wake-up's cost: a round trip between two threads on two of ``cpus`` (a reply from
    another process arrives on another CPU: an inter-processor interrupt) over two pipes (each
    trip wakes both) less the same four system calls made by one thread, halved."""
    r1, w1 = os.pipe()
    r2, w2 = os.pipe()

    def echo() -> None:
        os.sched_setaffinity(0, {cpus[1]})  # this thread only
        for _ in range(trips):
            os.read(r1, 1)
            os.write(w2, b"x")

    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cpus[0]})
        t = threading.Thread(target=echo, name="spin-calibration", daemon=True)
        t.start()
        pong = []
        for _ in range(trips):
            t0 = time.perf_counter()
            os.write(w1, b"x")
            os.read(r2, 1)
            pong.append(time.perf_counter() - t0)
        t.join()
        base = []
        for _ in range(trips):
            t0 = time.perf_counter()
            os.write(w1, b"x")
            os.read(r1, 1)
            os.write(w2, b"x")
            os.read(r2, 1)
            base.append(time.perf_counter() - t0)
    finally:
        os.sched_setaffinity(0, mine)
        for fd in (r1, w1, r2, w2):
            os.close(fd)
    return max(0.0, (statistics.median(pong) - statistics.median(base)) / 2 * 1e6)


def _step_us(rounds: int = 9) -> float:
    """Least time of a fixed loop of calls and dict work (a request's kind of Python) over
    ``rounds``: the per-core speed the windows scale with (the least, as other load only ever
    adds to it)."""
    d: dict[int, int] = {}

    def f(i: int) -> int:
        d[i & 63] = i
        return d.get(i & 31, 0)

    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i in range(2000):
            f(i)
        out.append(time.perf_counter() - t0)
    return min(out) * 1e6


@functools.cache
def machine() -> Machine:
    """This machine, measured once per process (first call)."""
    if not hasattr(os, "sched_getaffinity"):  # not Linux: no pinning to measure with
        return Machine(cpus=os.cpu_count() or 1, wake_us=REF_WAKE_US, step_us=_step_us())
    cpus = sorted(os.sched_getaffinity(0))
    wake = _wake_us(cpus[:2]) if len(cpus) >= 2 else 0.0
    return Machine(cpus=len(cpus), wake_us=wake, step_us=_step_us())


def window_s(configured_us: int, reference_us: float) -> float:
    """Seconds to spin: ``configured_us`` as given, or with `AUTO` the role's
    ``reference_us`` chosen for this machine (`Machine.window_us`)."""
    if configured_us != AUTO:
        return configured_us * 1e-6
    return machine().window_us(reference_us) * 1e-6
