"""Prefill queue orders: which waiting request a prefill instance serves next, registered by name.

Called by the adapters that keep a prefill queue — the live Conductor's `PrefillGate` and the
simulator's prefill nodes (`yuebing.sim.mooncake`) — with the waiting requests as
`QueuedPrefill`s (`QueueOrder.first`: the one to serve now), and by `Policy` for a new request's
queue wait: the work of the waiting requests ordered before it (`QueueOrder.ahead_s`). Each
order ranks by a key, lowest first; ties go to the request queued first. ``now_s`` comes from
the caller; nothing here reads a clock.

- ``fifo``: arrival order.
- ``sjf_aging``: shortest estimated prefill first, aged: key = prefill_s − aging · waited, the
  same ranking as prefill_s + aging · arrival_s. A request is overtaken only by requests that
  arrive within prefill_s / aging seconds after it, so none starves.
- ``edf``: earliest TTFT deadline first. A request that cannot meet its deadline even if started
  now ranks as if its deadline were one TTFT SLO later: it yields to those that still can, but
  only to those that arrived within one SLO after it. (With one SLO for every request and no
  late request this is arrival order.)
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

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
    def key(self, item: QueuedPrefill, now_s: float) -> float:
        """Rank of ``item`` at ``now_s``: lowest is served first."""

    def first(self, items: Sequence[QueuedPrefill], now_s: float) -> int:
        """Index in ``items`` (in queueing order) of the request to serve at ``now_s``."""
        best, best_key = 0, math.inf
        for i, item in enumerate(items):
            k = self.key(item, now_s)
            if k < best_key:
                best, best_key = i, k
        return best

    def order(self, items: Sequence[QueuedPrefill], now_s: float) -> list[int]:
        """Indices of ``items`` in the order they would be served if nothing else arrived and
        ``now_s`` stood still."""
        return sorted(range(len(items)), key=lambda i: (self.key(items[i], now_s), i))

    def ahead_s(self, items: Sequence[QueuedPrefill], new: QueuedPrefill, now_s: float) -> float:
        """Seconds of ``items``' work served before ``new``, which joins them at ``now_s``."""
        if self.arrival_order:
            return sum(item.prefill_s for item in items)
        k = self.key(new, now_s)
        return sum(item.prefill_s for item in items if self.key(item, now_s) <= k)


PREFILL_QUEUES: Registry[type[QueueOrder]] = Registry("prefill queue order")
DEFAULT_QUEUE = "fifo"
"""The order the Conductor and the simulator use unless told otherwise."""
DEFAULT_AGING = 0.1
"""``sjf_aging``'s default ageing (seconds of estimated prefill forgiven per second waited)."""


@PREFILL_QUEUES.register("fifo")
class Fifo(QueueOrder):
    """First come, first served."""

    arrival_order = True

    def key(self, item: QueuedPrefill, now_s: float) -> float:
        return item.arrival_s


@PREFILL_QUEUES.register("sjf_aging")
class ShortestFirstAging(QueueOrder):
    """Shortest estimated prefill first; each second waited counts ``aging`` seconds less."""

    def key(self, item: QueuedPrefill, now_s: float) -> float:
        return item.prefill_s + self.aging * item.arrival_s


@PREFILL_QUEUES.register("edf")
class EarliestDeadline(QueueOrder):
    """Earliest TTFT deadline first; a request already too late yields for one SLO."""

    def key(self, item: QueuedPrefill, now_s: float) -> float:
        late = now_s + item.prefill_s > item.deadline_s
        return item.deadline_s + (self.ttft_slo_s if late else 0.0)
