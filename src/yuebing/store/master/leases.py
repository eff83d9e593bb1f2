"""Read leases that end when the reads end: a lease protects a copy in flight, not a value for
``lease_ttl_s``.

Life of a lease: `grant` (from ``get_replicas``, and for the readers a promotion or a migration
answers) sets the object's ``lease`` expiry to now + ``lease_ttl_s`` and counts one more reader
in the key's open lease, whose id the reply carries (``lease_id``); readers of a key whose lease
is still running join it (same id). When a read is over — done, failed, or cut by its read
deadline — the client sends `ReleaseLeases` (one-way, no reply); `release` counts the reader out,
and when the last one is out the lease ends at once: the value is evictable, removable unforced,
and a draining replica no longer holds the drain. A reader that never releases (crashed, reply
lost) is bounded by the expiry as before. A release naming an older lease of the key (expired,
then granted anew) is ignored, so it cannot end a newer reader's lease. A lease granted while
the object was already leased without one (a new leader leases every value for
``lease_ttl_s``, `replication.take_over`) keeps that expiry as its floor. Leases are not
replicated; ids start at a random 48-bit base per master, so a release meant for another
leader's lease matches none here. ``sweep`` (from the tick, once per ``lease_ttl_s``) forgets
leases that expired.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.master.state import Obj

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore


class Leases:
    """The open leases of a core: key -> [readers, lease id, floor expiry]."""

    __slots__ = ("next_sweep", "open", "seq")

    def __init__(self) -> None:
        self.open: dict[str, list] = {}
        self.seq = secrets.randbits(48)
        self.next_sweep = 0.0


def grant(core: MasterCore, key: str, o: Obj, readers: int = 1) -> int:
    """Lease ``o`` (committed under ``key``) to ``readers`` more readers for ``lease_ttl_s``;
    returns the lease id for their replies (0 with ``--lease-ttl-s 0``: no lease). With no
    reader (a promotion nobody waits for) the expiry alone is set, as a floor."""
    ttl = core.cfg.lease_ttl_s
    if ttl <= 0:
        return 0
    now = core.clock.now()
    ls = core.leases
    entry = ls.open.get(key)
    if readers <= 0:
        o.lease = max(o.lease, now + ttl)
        if entry is not None:  # readers' releases must not end it before then
            entry[2] = max(entry[2], now + ttl)
        return 0
    if entry is None or o.lease <= now:  # a new lease (the old one, if any, has expired)
        ls.seq += 1
        entry = ls.open[key] = [readers, ls.seq, o.lease if entry is None else 0.0]
    else:
        entry[0] += readers
    o.lease = now + ttl
    return entry[1]


def release(core: MasterCore, msg: m.ReleaseLeases) -> None:
    """`ReleaseLeases`: count each reader out of its lease; the last one out ends it (the
    object's expiry falls back to the floor, usually none). No reply."""
    if len(msg.keys) != len(msg.ids):
        return  # malformed: nothing to match (one-way, so nobody to answer)
    now = core.clock.now()
    for key, lid in zip(msg.keys, msg.ids, strict=True):
        count_out(core, key, lid, now, end=True)


def count_out(core: MasterCore, key: str, lid: int, now: float, end: bool) -> None:
    """One reader of ``key``'s lease ``lid`` is out (a stale ``lid``: nothing). When it was
    the last: the lease is forgotten and, with ``end``, the object's expiry falls back to
    its floor (without: it runs out at its expiry — a get whose reply waits for a promotion
    gave back the count it took, the expiry still covers the move)."""
    ls = core.leases
    entry = ls.open.get(key)
    if entry is None or entry[1] != lid:
        return
    entry[0] -= 1
    if entry[0] > 0:
        return
    del ls.open[key]
    o = core.objs.get(key)
    if end and o is not None and o.lease > now:
        o.lease = entry[2] if entry[2] > now else 0.0
        if not o.lease:  # no reader holds any of its replicas, a draining one included
            core.drains.handed.pop(key, None)


def sweep(core: MasterCore) -> None:
    """Forget leases that expired (their readers never released them); from the tick, at
    most once per ``lease_ttl_s``."""
    ls = core.leases
    now = core.clock.now()
    if now < ls.next_sweep or not ls.open:
        return
    ls.next_sweep = now + max(core.cfg.lease_ttl_s, 1.0)
    objs = core.objs
    for key in [k for k, e in ls.open.items()
                if (o := objs.get(k)) is None or o.lease <= now]:
        del ls.open[key]
