"""Client side of reserve-ahead puts (`ClientConfig.reserve_ahead`): the reservations a store
client holds, one per value shape (a list of n for batches), and when to ask for one. Used by
the put steps (`puts`).

The second put of a shape within the last `RECENT` asks the master for one
(`PutStart.reserve_next`); the next put of that shape `take`s it while at least half of its
write time is left. Stale ones are given back as unused (never written: freed at once) or
left to the master, which reclaims them at their write expiry. At most `MAX_HELD` shapes and
`MAX_PER_CLIENT` reservations are held, the master's own caps.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from yuebing.protocol import store as m

MAX_HELD = 4
"""Shapes held (the master's `reserve.MAX_SHAPES`)."""
MAX_PER_CLIENT = 64
"""Reservations held in all shapes together (the master's `reserve.MAX_PER_CLIENT`)."""
MAX_PER_SHAPE = MAX_PER_CLIENT
"""Reservations held of one shape: a batch of more items is put the two-phase way."""
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

    @property
    def forget_at(self) -> float:
        """When a copy of this reservation from any reply can no longer be usable: a reply
        carrying it left the master before its write expiry, which is at most one network delay
        after ``deadline`` (a conservative estimate), and a copy needs half its grant left."""
        return self.deadline + self.granted_s


class HeldReservations:
    """The reservations of one client (one thread at a time, or the coroutines of one event
    loop: puts use `claim`/`release`, see the module docstring).

    Puts `claim` a reservation (`claim_many` for a batch), which takes it and keeps its key
    *busy* (in use, then committed or revoked), so a reply still in flight that carries it — the
    master answers a `PutStart` with the reservation of the shape it has — is not kept and handed to
    a second put, which would overwrite the committed value. `claim` pops and marks busy with no
    await between. A busy key is forgotten once any copy of it would be unusable anyway
    (`Held.forget_at`); a commit the master refused `release`s it (for a batch, also each item the
    commit refused). Reservations on a segment a write failed to reach, and those held at `close`,
    are given back."""

    def __init__(self) -> None:
        self.held: dict[Shape, list[Held]] = {}
        self._seen: dict[Shape, None] = {}
        self.busy: dict[str, float] = {}
        """Keys of claimed reservations -> when to forget them (`Held.forget_at`)."""
        self._forget: list[tuple[float, str]] = []
        """`busy` entries by when to forget them (a heap): forgetting costs O(log n) per key,
        not a scan of every busy key at each put."""
        self._stale_at = float("inf")
        """No held reservation turns stale before this (monotonic; `drop_stale`)."""

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
        """Remove and return the oldest reservation of ``shape`` as (usable, stale): at most
        one set."""
        hs = self.held.get(shape)
        if not hs:
            return None, None
        h = hs.pop(0)
        if not hs:
            del self.held[shape]
        return (h, None) if h.usable(now) else (None, h)

    def take_many(self, shape: Shape, n: int, now: float) -> tuple[list[Held], list[Held]]:
        """For a batch of ``n``: (``n`` usable reservations of ``shape``, removed — or none if
        fewer are held, which stay held —, the stale ones, removed)."""
        hs = self.held.get(shape, [])
        usable = [h for h in hs if h.usable(now)]
        stale = [h for h in hs if not h.usable(now)]
        if len(usable) < n:
            if stale:
                self._set(shape, usable)
            return [], stale
        self._set(shape, usable[n:])
        return usable[:n], stale

    def drop_stale(self, now: float) -> list[str]:
        """Remove the held reservations (of every shape) no longer usable and return the keys
        of those whose write expiry has not passed (to give back unused; the master reclaimed
        the others). They are marked busy, so a late reply carrying one is not held again.
        O(1) until one may be stale."""
        if now < self._stale_at:
            return []
        self._forget_busy(now)
        out: list[str] = []
        soonest = float("inf")
        for shape, hs in list(self.held.items()):
            keep = [h for h in hs if h.usable(now)]
            for h in hs:
                if not h.usable(now):
                    self._mark_busy(h)
                    if h.deadline > now:
                        out.append(h.key)
            soonest = min([soonest, *(h.deadline - h.granted_s / 2 for h in keep)])
            self._set(shape, keep)
        self._stale_at = soonest
        return out

    def _set(self, shape: Shape, hs: list[Held]) -> None:
        if hs:
            self.held[shape] = hs
        else:
            self.held.pop(shape, None)

    def claim(self, shape: Shape, now: float) -> tuple[Held | None, str | None]:
        """`take` for concurrent puts: (the reservation this put alone writes into, or None;
        the key of a stale one to give back now, or None — one past its write expiry the master
        reclaimed already). Either is marked busy, so `keep` ignores later copies of it."""
        self._forget_busy(now)
        held, stale = self.take(shape, now)
        for h in (held, stale):
            if h is not None:
                self._mark_busy(h)
        if stale is not None and stale.deadline > now:
            return None, stale.key
        return held, None

    def claim_many(self, shape: Shape, n: int, now: float) -> tuple[list[Held], list[Held]]:
        """`take_many` for concurrent batches (`claim`): the same pair, every one of them
        marked busy with no await possible in between (the caller's coroutine runs this
        synchronously)."""
        self._forget_busy(now)
        held, stale = self.take_many(shape, n, now)
        for h in (*held, *stale):
            self._mark_busy(h)
        return held, stale

    def _mark_busy(self, h: Held) -> None:
        self.busy[h.key] = h.forget_at
        heapq.heappush(self._forget, (h.forget_at, h.key))

    def _forget_busy(self, now: float) -> None:
        """Forget the busy keys whose `Held.forget_at` passed (a key marked busy again later
        keeps its later time; one `release`d is gone already)."""
        heap = self._forget
        while heap and heap[0][0] <= now:
            t, key = heapq.heappop(heap)
            if self.busy.get(key) == t:
                del self.busy[key]

    def release(self, key: str) -> None:
        """The master refused the commit into claimed ``key``: nothing was stored in it, and it
        may hand the same reservation out again (to be kept and claimed anew)."""
        self.busy.pop(key, None)

    def keep(self, shape: Shape, r: m.Reservation | None, sent: float) -> None:
        """Hold ``r`` (from a reply to a request sent at monotonic ``sent``)."""
        if r is not None:
            self.keep_many(shape, [r], sent)

    def keep_many(self, shape: Shape, rs: list[m.Reservation], sent: float) -> None:
        """Hold ``rs`` (from a reply to a request sent at monotonic ``sent``; the master lists
        the ones the client may hold already first: those are refreshed in place, not held
        twice). Mirrors what the master did when it placed ``rs`` (`Reserve.reserve_many`), so
        that no held reservation is one it dropped: a shape not held over `MAX_HELD` shapes
        drops the oldest shape's; more than `MAX_PER_CLIENT` in all drop the oldest of the
        first other shape (shapes and reservations in the master's order, oldest first). A
        claimed (busy) reservation is never held again."""
        rs = [r for r in rs if r.key not in self.busy]
        if not rs:
            return
        hs = self.held.get(shape)
        if hs is None:
            while len(self.held) >= MAX_HELD:
                del self.held[next(iter(self.held))]
            hs = self.held[shape] = []
        at = {h.key: i for i, h in enumerate(hs)}
        for r in rs:
            h = Held(r.key, r.replicas, sent + r.expires_in_s, r.expires_in_s)
            self._stale_at = min(self._stale_at, h.deadline - h.granted_s / 2)
            if r.key in at:
                hs[at[r.key]] = h
            else:
                at[r.key] = len(hs)
                hs.append(h)
        over = sum(len(x) for x in self.held.values()) - MAX_PER_CLIENT
        while over > 0:
            other = next((sh for sh in self.held if sh != shape), shape)
            ks = self.held[other]
            cut = min(over, len(ks)) if other != shape else over
            self._set(other, ks[cut:])
            over -= cut

    def touching(self, segments: list[str]) -> list[str]:
        """Remove and return the reservations with a replica on one of ``segments`` (marked
        busy: given back unused, a late copy of one must not be held again)."""
        bad = set(segments)
        out: list[str] = []
        for shape, hs in list(self.held.items()):
            hit = [h for h in hs if any(r.segment in bad for r in h.replicas)]
            if hit:
                out += [h.key for h in hit]
                for h in hit:
                    self._mark_busy(h)
                self._set(shape, [h for h in hs if h not in hit])
        return out

    def pop_all(self) -> list[str]:
        """Remove and return every held reservation's key (to give them back on close)."""
        keys = [h.key for hs in self.held.values() for h in hs]
        self.held.clear()
        return keys
