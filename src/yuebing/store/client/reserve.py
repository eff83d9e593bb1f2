"""Client side of reserve-ahead puts (`ClientConfig.reserve_ahead`): the reservations a
`StoreClient` holds, one per value shape, and when to ask for one.

Life cycle: the second put of a shape (size, replicas, strategy, preferred) within the last
`RECENT` shapes asks the master for a reservation (`PutStart.reserve_next`); the reply's
`Reservation` is kept here with its write deadline on this process's monotonic clock (its
``expires_in_s`` counted from before the request, like a put's). The next put of that shape
`take`s it: usable while at least half of the write time it was granted is left, so the write
gets most of a fresh put's budget; an older one is handed back as stale, and the client revokes
it then (lazily: a client that stops putting leaves it to the master, which reclaims a
reservation at its write expiry). A write or commit through a reservation that fails falls back
to the two-phase put. At most `MAX_HELD` are held (the master's cap per client too).
"""

from __future__ import annotations

from dataclasses import dataclass

from yuebing.store import messages as m

MAX_HELD = 4
RECENT = 8

Shape = tuple[int, int, str, tuple[str, ...]]


def shape_of(it: m.PutItem) -> Shape:
    """What a reservation must match to take ``it`` (the master checks the same at commit)."""
    return (it.size, it.replicas, it.strategy, tuple(it.preferred))


@dataclass(slots=True)
class Held:
    """One reservation: where to write, and by when (monotonic) of how long it was granted."""

    key: str
    replicas: list[m.Replica]
    deadline: float
    granted_s: float

    def usable(self, now: float) -> bool:
        return self.deadline - now >= self.granted_s / 2


class HeldReservations:
    """The reservations of one client (one thread at a time, like `StoreClient`)."""

    def __init__(self) -> None:
        self.held: dict[Shape, Held] = {}
        self._seen: dict[Shape, None] = {}

    def want(self, shape: Shape) -> bool:
        """Should a put of ``shape`` ask for a reservation? Yes when the shape was put lately
        (a stream), so a client of many one-off sizes does not tie space up — and not while
        `MAX_HELD` others are held: the master would drop the oldest, whose space then waits
        out the write fence (tens of seconds), so cycling through more shapes than that would
        fill memory with fenced reservations."""
        seen = shape in self._seen
        if seen:
            del self._seen[shape]
        elif len(self._seen) >= RECENT:
            del self._seen[next(iter(self._seen))]
        self._seen[shape] = None
        return seen and (shape in self.held or len(self.held) < MAX_HELD)

    def take(self, shape: Shape, now: float) -> tuple[Held | None, Held | None]:
        """Remove and return the reservation of ``shape`` as (usable, stale): at most one set."""
        h = self.held.pop(shape, None)
        if h is None:
            return None, None
        return (h, None) if h.usable(now) else (None, h)

    def keep(self, shape: Shape, r: m.Reservation | None, sent: float) -> None:
        """Hold ``r`` (from a reply to a request sent at monotonic ``sent``). Over `MAX_HELD`
        the oldest is forgotten: the master dropped it when it placed ``r`` (same cap)."""
        if r is None:
            return
        self.held.pop(shape, None)
        while len(self.held) >= MAX_HELD:
            del self.held[next(iter(self.held))]
        self.held[shape] = Held(r.key, r.replicas, sent + r.expires_in_s, r.expires_in_s)

    def touching(self, segments: list[str]) -> list[str]:
        """Remove and return the reservations with a replica on one of ``segments``."""
        bad = set(segments)
        out = [s for s, h in self.held.items() if any(r.segment in bad for r in h.replicas)]
        return [self.held.pop(s).key for s in out]

    def pop_all(self) -> list[str]:
        keys = [h.key for h in self.held.values()]
        self.held.clear()
        return keys
