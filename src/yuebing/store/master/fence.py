"""The master's half of the write fence: space of a put that ended without a commit is not
reused until no byte of that put can still land in it.

Life cycle: ``put_start`` decides the put's write expiry (`write_expiry`: now + the shorter of
``put_timeout_s`` and the client's transfer timeout) and returns it to the client as seconds
from now; the client's transfer engine stamps it on every write frame, and targets refuse or
cut writes after it (plus their ``write_grace_s``). When the put is revoked, reclaimed as a
zombie or dropped with its client's session, `release` does not free its ranges: they wait in
the `Quarantine` until expiry + ``write_grace_s`` + ``fence_s`` (clock skew between master,
client and nodes), and `Quarantine.release_due` (from the core's tick) frees them then. Ranges
of committed objects are freed at once: their writes completed before ``put_end``.

Standbys keep quarantines too (their pending puts' expiries are taken conservatively as now +
``put_timeout_s`` when an entry arrives); snapshots carry them, and ``take_over`` keeps their
ranges allocated until they are due.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import TYPE_CHECKING

from yuebing.store.master.state import ObjState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore
    from yuebing.store.master.state import Obj, Seg

log = logging.getLogger(__name__)


class Quarantine:
    """Ranges held back from the allocators until a time: a heap of
    ``(until, seq, segment id, offset, size)``. Segments dropped meanwhile are skipped."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, until: float, sid: int, off: int, size: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (until, self._seq, sid, off, size))

    def release_due(self, now: float, segs: dict[int, Seg]) -> int:
        """Free (into their segments' allocators, where there is one) every range due by
        ``now``; returns how many bytes were released."""
        heap, freed = self._heap, 0
        while heap and heap[0][0] <= now:
            _, _, sid, off, size = heapq.heappop(heap)
            s = segs.get(sid)
            if s is not None and s.alloc is not None:
                s.alloc.free_range(off, size)
                freed += size
        return freed

    def bytes(self, segs: dict[int, Seg]) -> int:
        """Bytes held back on segments still mounted (they count as used there)."""
        return sum(e[4] for e in self._heap if e[2] in segs)

    def ranges(self, sid: int) -> list[tuple[int, int]]:
        """The (offset, size) ranges held on segment ``sid``."""
        return [(e[3], e[4]) for e in self._heap if e[2] == sid]

    def settle(self, sid: int, taken: list[tuple[int, int]], alignment: int) -> list[tuple[int, int]]:
        """Make the entries of segment ``sid`` consistent with ``taken`` (its objects' ranges)
        before an allocator rebuild (`replication.take_over`), and return the ranges they hold.
        A standby's fence ends later than its leader's, so the leader may already have given a
        quarantined range to a new object: such entries are dropped (that object holds the
        range); overlapping entries are merged into one, due at the later time."""
        def end(off: int, size: int) -> int:
            return off + -(-size // alignment) * alignment

        objs = sorted((off, end(off, size)) for off, size in taken)
        starts = [o[0] for o in objs]
        held: list[list[float]] = []  # [start, stop, until]
        for until, _, _, off, size in sorted(
                (e for e in self._heap if e[2] == sid), key=lambda e: e[3]):
            stop = end(off, size)
            i = bisect.bisect_right(starts, off)
            if (i and objs[i - 1][1] > off) or (i < len(objs) and objs[i][0] < stop):
                continue
            if held and held[-1][1] >= off:
                held[-1][1] = max(held[-1][1], stop)
                held[-1][2] = max(held[-1][2], until)
            else:
                held.append([off, stop, until])
        self._heap = [e for e in self._heap if e[2] != sid]
        heapq.heapify(self._heap)
        for a, b, until in held:
            self.add(until, sid, int(a), int(b - a))
        return [(int(a), int(b - a)) for a, b, _ in held]

    def dump(self, now: float) -> list[list[float]]:
        """Entries with times relative to ``now`` (snapshots: clocks differ between hosts)."""
        return [[max(0.0, e[0] - now), e[2], e[3], e[4]] for e in self._heap]

    def load(self, now: float, entries: list[list[float]]) -> None:
        self._heap.clear()
        for left, sid, off, size in entries:
            self.add(now + left, int(sid), int(off), int(size))


def write_expiry(core: MasterCore, now: float, requested_s: float) -> float:
    """When the put started ``now`` must stop writing: the shorter of ``put_timeout_s`` and the
    client's requested transfer timeout (0 = none requested)."""
    limit = core.cfg.put_timeout_s
    return now + (min(limit, requested_s) if requested_s > 0 else limit)


def expires_in(core: MasterCore, keys: list[str]) -> float:
    """Seconds from now until the earliest write expiry of the pending puts ``keys`` (what
    `PutTargets` / `BatchPutTargets` return; 0 if it passed already)."""
    now = core.clock.now()
    ends = [core.expiry[k] for k in keys if k in core.expiry]
    return max(0.0, min(ends) - now) if ends else 0.0


def release(core: MasterCore, key: str, o: Obj) -> list[str]:
    """Give back the ranges of ``o`` (being dropped by the core): a committed object's at once,
    a pending put's into the quarantine until its fence (at once if that passed already).
    Returns the names of the segments that held it."""
    holders: list[str] = []
    until = 0.0
    now = core.clock.now()
    if o.state == ObjState.PENDING and o.reps:
        expiry = core.expiry.get(key, now + core.cfg.put_timeout_s)
        until = expiry + core.cfg.write_grace_s + core.cfg.fence_s
    for sid, off in o.reps:
        s = core.segs.get(sid)
        if s is None:
            continue
        holders.append(s.name)
        if until > now:
            core.quarantine.add(until, sid, off, o.size)
        elif s.alloc is not None:
            s.alloc.free_range(off, o.size)
    if until > now:
        core.counters["quarantined"] += 1
        log.info("put %s ended uncommitted: %d range(s) quarantined for %.2fs", key,
                 len(holders), until - now)
    core.expiry.pop(key, None)
    return holders
