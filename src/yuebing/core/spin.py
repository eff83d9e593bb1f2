"""`Spinner`: bounded, adaptive busy-polling before a blocking wait.

It lives in `core` because both the transfer engine and the store use it. Who calls it: the
inline TCP path (`transfer.transport.tcp_inline.InlineConn`, waiting for a peer's answer) and the
store's RPC framing (`yuebing.store.wire`: a client waiting for the master's reply, the master
waiting for the next request), each from its own thread, just before it would block in the
kernel. A process that sleeps waiting for a loopback answer is woken by an inter-processor
interrupt, which on a virtual machine without guest halt-polling costs ~20 us — more than the
master's work per call. Polling for a short window instead avoids that wake-up.

Between polls the thread yields the CPU (``sched_yield``), so a peer sharing the CPU (the
master, when client and master run on one core) runs first. When the CPU is contended by other
work the yield hands it away for a whole time slice, and a task that never sleeps loses the
wake-up preemption a sleeping one gets — spinning then costs milliseconds. So a yield that
takes longer than `LOST_S` without the awaited event turns spinning off for a back-off period
that doubles with every loss up to `MAX_BACKOFF_S` and halves with every spin that catches its
event (on a busy machine spinning resumes about once a second, costing at most one lost time
slice per second; once the machine is quiet again it is back within a few calls); the caller
then blocks as usual.

A server that spins after every request it serves (the store master) also uses a
`GapPredictor`: it spins only while requests have recently been arriving within the window, so a
steady trickle of requests further apart than the window (heartbeats) costs no spinning at all.

How long to spin is chosen per machine, not fixed (`window_s`, `machine`): a configured window
of -1 ("auto") is the role's reference window — what the awaited answer takes on a core where
`REF_STEP_US` of reference Python work takes that long — scaled by this machine's measured
per-core speed, and no spinning at all where it cannot pay: a single CPU (the peer being waited
for needs it) or wake-ups measured as cheap as a poll (bare metal with idle polling).
Measured once per process, on first use (~10-30 ms): a pipe ping-pong between two threads
(each trip two wake-ups) less the same system calls without one, and a fixed Python loop.
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


class Spinner:
    """Per-thread spin state (not thread-safe: one per connection / serving loop)."""

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
    does not disable spinning for long). Called by a serving loop once per arrival."""

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
