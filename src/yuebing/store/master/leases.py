"""Read leases that end when the reads end: `Leases` (a lease protects a copy in flight, not a
value for ``lease_ttl_s``).

`grant` (from `Reads`, and for the readers a promotion or migration answers) sets the object's
``lease`` expiry to now + ``lease_ttl_s`` and counts a reader into the key's open lease, whose id
the reply carries; `release` (the client's one-way `ReleaseLeases`) counts it out, and the last
reader out ends the lease at once. A stale id is ignored; a lease granted over a new leader's
blanket lease keeps that expiry as its floor; `sweep` (tick) forgets expired ones. Leases are
not replicated. ``handed`` notes replies that named a draining replica (read by `Migrations`).
"""

from __future__ import annotations

import secrets

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.objects import Objects
from yuebing.store.master.state import Obj


class Leases:
    """``open``: key -> [readers, lease id, floor expiry]; ``seq``: the last lease id (from a
    random 48-bit base per master); ``handed``: key -> lease end of a reply naming a draining
    replica."""

    __slots__ = ("cfg", "clock", "handed", "next_sweep", "objects", "open", "seq")

    def __init__(self, cfg: MasterConfig, clock: Clock, objects: Objects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.objects = objects
        self.open: dict[str, list] = {}
        self.seq = secrets.randbits(48)
        self.next_sweep = 0.0
        self.handed: dict[str, float] = {}

    def grant(self, key: str, o: Obj, readers: int = 1) -> int:
        """Lease ``o`` (committed under ``key``) to ``readers`` more readers for
        ``lease_ttl_s``; returns the lease id for their replies (0 with ``--lease-ttl-s 0``: no
        lease). With no reader (a promotion nobody waits for) the expiry alone is set, as a
        floor."""
        ttl = self.cfg.lease_ttl_s
        if ttl <= 0:
            return 0
        now = self.clock.now()
        entry = self.open.get(key)
        if readers <= 0:
            o.lease = max(o.lease, now + ttl)
            if entry is not None:  # readers' releases must not end it before then
                entry[2] = max(entry[2], now + ttl)
            return 0
        if entry is None or o.lease <= now:  # a new lease (the old one, if any, has expired)
            self.seq += 1
            entry = self.open[key] = [readers, self.seq, o.lease if entry is None else 0.0]
        else:
            entry[0] += readers
        o.lease = now + ttl
        return entry[1]

    def release(self, msg: m.ReleaseLeases) -> None:
        """`ReleaseLeases`: count each reader out of its lease; the last one out ends it (the
        object's expiry falls back to the floor, usually none). No reply."""
        if len(msg.keys) != len(msg.ids):
            return  # malformed: nothing to match (one-way, so nobody to answer)
        now = self.clock.now()
        for key, lid in zip(msg.keys, msg.ids, strict=True):
            self.count_out(key, lid, now, end=True)

    def count_out(self, key: str, lid: int, now: float, end: bool) -> None:
        """One reader of ``key``'s lease ``lid`` is out (a stale ``lid``: nothing). When it was
        the last: the lease is forgotten and, with ``end``, the object's expiry falls back to
        its floor (without: it runs out at its expiry — a get whose reply waits for a promotion
        gave back the count it took, the expiry still covers the move)."""
        entry = self.open.get(key)
        if entry is None or entry[1] != lid:
            return
        entry[0] -= 1
        if entry[0] > 0:
            return
        del self.open[key]
        o = self.objects.objs.get(key)
        if end and o is not None and o.lease > now:
            o.lease = entry[2] if entry[2] > now else 0.0
            if not o.lease:  # no reader holds any of its replicas, a draining one included
                self.handed.pop(key, None)

    def sweep(self) -> None:
        """Forget leases that expired (their readers never released them); from the tick, at
        most once per ``lease_ttl_s``."""
        now = self.clock.now()
        if now < self.next_sweep or not self.open:
            return
        self.next_sweep = now + max(self.cfg.lease_ttl_s, 1.0)
        objs = self.objects.objs
        for key in [k for k, e in self.open.items()
                    if (o := objs.get(k)) is None or o.lease <= now]:
            del self.open[key]

    # -------------------------------------------------------------- replies naming draining replicas
    def hand_out(self, key: str, until: float) -> None:
        """A reply naming a draining replica of ``key`` was given, its lease running to
        ``until``."""
        self.handed[key] = until

    def keep_handout(self, key: str, until: float) -> None:
        """Note a reader holding ``key``'s replicas until ``until``, unless one noted runs
        longer (`Migrations.keep_lease`)."""
        if until > self.handed.get(key, 0.0):
            self.handed[key] = until

    def forget_handouts(self) -> None:
        """No drain runs any more: the hand-outs noted for drains are moot."""
        self.handed.clear()

    def handed_running(self, key: str, now: float) -> bool | None:
        """Whether a hand-out noted for ``key`` still runs at ``now`` (None: none noted; an
        expired one is forgotten)."""
        handed = self.handed.get(key)
        if handed is None:
            return None
        if handed > now:
            return True
        del self.handed[key]
        return None
