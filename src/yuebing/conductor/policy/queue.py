"""Prefill queue orders: which waiting request a prefill instance serves next, registered by name.

Called by the adapters that keep a prefill queue — the live Conductor's `PrefillGate` and the
simulator's prefill nodes — with the waiting `QueuedPrefill`s (`QueueOrder.first`: the one to
serve now), and by `Policy` for a new request's queue wait (`QueueOrder.ahead_s`). Orders:
``fifo`` (`Fifo`), ``sjf_aging`` (`ShortestFirstAging`), ``edf`` (`EarliestDeadline`),
``sjf_slack`` (`ShortestFirstInSlack`, the live default); ties go to the request queued first.
``now_s`` comes from the caller; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from yuebing.conductor.policy.types import QueuedPrefill
from yuebing.core.registry import Registry


class QueueOrder(ABC):
    """One order of a prefill queue (see the module docstring for who calls it)."""

    arrival_order = False
    """True when the order is arrival order: a request's turn is known when it arrives."""

    def __init__(self, aging: float, ttft_slo_s: float) -> None:
        self.aging = aging
        self.ttft_slo_s = ttft_slo_s

    @abstractmethod
    def order(self, items: Sequence[QueuedPrefill], now_s: float,
              start_s: float | None = None) -> list[int]:
        """Indices of ``items`` (in queueing order) in the order they would be served from
        ``start_s`` (default ``now_s``) on, if nothing else arrived."""

    def first(self, items: Sequence[QueuedPrefill], now_s: float) -> int:
        """Index in ``items`` of the request to serve at ``now_s``."""
        return self.order(items, now_s)[0]

    def ahead_s(self, items: Sequence[QueuedPrefill], new: QueuedPrefill, now_s: float,
                start_s: float | None = None) -> float:
        """Seconds of ``items``' work served before ``new``, which joins them at ``now_s``
        (the first of them can start at ``start_s``)."""
        if self.arrival_order:
            return sum(item.prefill_s for item in items)
        ahead = 0.0
        for i in self.order([*items, new], now_s, start_s):
            if i == len(items):
                return ahead
            ahead += items[i].prefill_s
        raise AssertionError("order() lost an item")


class KeyOrder(QueueOrder):
    """An order by a per-request key, lowest first (ties: queued first)."""

    @abstractmethod
    def key(self, item: QueuedPrefill, now_s: float) -> float:
        """Rank of ``item`` at ``now_s``."""

    def order(self, items: Sequence[QueuedPrefill], now_s: float,
              start_s: float | None = None) -> list[int]:
        return sorted(range(len(items)), key=lambda i: (self.key(items[i], now_s), i))

    def first(self, items: Sequence[QueuedPrefill], now_s: float) -> int:
        best, best_key = 0, math.inf
        for i, item in enumerate(items):
            k = self.key(item, now_s)
            if k < best_key:
                best, best_key = i, k
        return best

    def ahead_s(self, items: Sequence[QueuedPrefill], new: QueuedPrefill, now_s: float,
                start_s: float | None = None) -> float:
        if self.arrival_order:
            return sum(item.prefill_s for item in items)
        k = self.key(new, now_s)
        return sum(item.prefill_s for item in items if self.key(item, now_s) <= k)


PREFILL_QUEUES: Registry[type[QueueOrder]] = Registry("prefill queue order")
DEFAULT_QUEUE = "sjf_slack"
"""The live Conductor's order unless told otherwise: in the simulated 1P1D on the serving head to
head's workload it sustains the highest rate at ≥ 90 % SLO attainment, and under overload it keeps
early rejection's promise to the requests admitted (docs/benchmarks.md, ``benchmarks/
prefill_queue.py``, ``benchmarks/overload_live.py --sim-only``). The simulator defaults to
``fifo``, the order its paper reproduction is pinned on."""
DEFAULT_AGING = 0.1
"""``sjf_aging``'s and ``sjf_slack``'s default ageing (seconds of estimated prefill forgiven per
second waited)."""


@PREFILL_QUEUES.register("fifo")
class Fifo(KeyOrder):
    """First come, first served."""

    arrival_order = True

    def key(self, item: QueuedPrefill, now_s: float) -> float:
        return item.arrival_s


@PREFILL_QUEUES.register("sjf_aging")
class ShortestFirstAging(KeyOrder):
    """Shortest estimated prefill first; each second waited counts ``aging`` seconds less.

    ``sjf_aging``: key = prefill_s − aging · waited, the same ranking as prefill_s + aging ·
    arrival_s. A request is overtaken only by requests arriving within prefill_s / aging seconds
    after it, so none starves."""

    def key(self, item: QueuedPrefill, now_s: float) -> float:
        return item.prefill_s + self.aging * item.arrival_s


@PREFILL_QUEUES.register("edf")
class EarliestDeadline(QueueOrder):
    """Earliest deadline first over the most requests that can all meet theirs (Moore-Hodgson);
    the others follow, each ranked as if due one TTFT SLO later.

    ``edf``: Moore-Hodgson — in deadline order, whenever one would be late, the longest so far is
    set aside; the ones set aside follow, each ranked as if due one TTFT SLO later, so a request
    yields only to those that arrived within one SLO after it. (With one SLO for every request and
    nobody late this is arrival order.)"""

    def order(self, items: Sequence[QueuedPrefill], now_s: float,
              start_s: float | None = None) -> list[int]:
        t = now_s if start_s is None else start_s
        kept: list[int] = []
        longest: list[tuple[float, int]] = []  # max-heap of (-prefill_s, index) over kept
        dropped: set[int] = set()
        for i in sorted(range(len(items)), key=lambda i: (items[i].deadline_s, i)):
            kept.append(i)
            heapq.heappush(longest, (-items[i].prefill_s, i))
            t += items[i].prefill_s
            if t > items[i].deadline_s:  # someone misses: drop the longest kept so far
                _, j = heapq.heappop(longest)
                dropped.add(j)
                t -= items[j].prefill_s
        slo = self.ttft_slo_s
        return sorted(range(len(items)),
                      key=lambda i: (items[i].deadline_s + (slo if i in dropped else 0.0), i))


EXACT_AHEAD_MAX = 64
"""``sjf_slack``'s `ShortestFirstInSlack.ahead_s` is exact up to this many queued requests."""


@PREFILL_QUEUES.register("sjf_slack")
class ShortestFirstInSlack(QueueOrder):
    """Shortest first (``sjf_aging``'s key) wherever it makes no request late that the
    deadline order would serve on time; otherwise the deadline order's next.

    ``sjf_slack``, at each choice from time t: the reference order R walks the requests by
    deadline (ties: queued first) and keeps each whose prefill still ends by its deadline after
    those kept before it; a request not kept ranks as due one TTFT SLO later (as in ``edf``),
    among the kept by that rank. The requests on time in R are protected: the first request in
    ``sjf_aging``'s key order that, moved to the front of R, delays no protected request past
    its deadline, is served (R's first always qualifies). A new request with the latest
    deadline is kept only behind all kept before it, so it never displaces one; hence a request
    on time when it is queued stays on time (with exact estimates) unless one queued over a
    TTFT SLO before it is late. Nobody starves: a request is passed only by those with a lower
    key (arrived within prefill_s / aging after it) or those fitting in the slack of the
    protected ones ahead of it in R, whose set stops growing one SLO after its deadline."""

    def _serve(self, items: Sequence[QueuedPrefill], t: float) -> Iterator[int]:
        """Indices of ``items`` in the order served from ``t`` on (lazily: each O(n))."""
        n, slo = len(items), self.ttft_slo_s
        by_deadline = sorted(range(n), key=lambda i: (items[i].deadline_s, i))
        by_key = sorted(range(n), key=lambda i: (items[i].prefill_s
                                                 + self.aging * items[i].arrival_s, i))
        served = [False] * n
        room = [0.0] * n  # slack of the protected requests ahead of each one in R
        for _ in range(n):
            kept: list[int] = []
            late: list[int] = []
            end = t
            for i in by_deadline:
                if served[i]:
                    continue
                if end + items[i].prefill_s <= items[i].deadline_s:
                    kept.append(i)
                    end += items[i].prefill_s
                else:
                    late.append(i)
            end, slack = t, math.inf
            ref = heapq.merge(((items[i].deadline_s, i) for i in kept),
                              ((items[i].deadline_s + slo, i) for i in late))
            for _, i in ref:
                room[i] = slack
                end += items[i].prefill_s
                if end <= items[i].deadline_s:
                    slack = min(slack, items[i].deadline_s - end)
            c = next(i for i in by_key if not served[i] and items[i].prefill_s <= room[i])
            served[c] = True
            t += items[c].prefill_s
            yield c

    def order(self, items: Sequence[QueuedPrefill], now_s: float,
              start_s: float | None = None) -> list[int]:
        return list(self._serve(items, now_s if start_s is None else start_s))

    def first(self, items: Sequence[QueuedPrefill], now_s: float) -> int:
        return next(self._serve(items, now_s))

    def ahead_s(self, items: Sequence[QueuedPrefill], new: QueuedPrefill, now_s: float,
                start_s: float | None = None) -> float:
        """Replays the choices until ``new`` is served: O(n^2) for n queued. Beyond
        `EXACT_AHEAD_MAX` queued (an overloaded instance, on the Conductor's path per arrival)
        the bound of serving it last: all of their work."""
        if len(items) > EXACT_AHEAD_MAX:
            return sum(item.prefill_s for item in items)
        ahead = 0.0
        for i in self._serve([*items, new], now_s if start_s is None else start_s):
            if i == len(items):
                return ahead
            ahead += items[i].prefill_s
        raise AssertionError("_serve() lost an item")
