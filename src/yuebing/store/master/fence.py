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

A segment dropped with its node's session (`segment_dropped`, from ``segments.drop_segment``)
keeps its fence: the ranges its pending puts held there join the quarantine (so do the
destinations of node tasks writing there: `segments.drop_segment` fails those tasks first, while
the segment is mounted), and its entries are kept by segment name until due. A node that was only partitioned still has its buffer and may
still receive a late frame, so when it mounts the same name again (under a new id,
``segments.add_segment``) `Quarantine.adopt` moves the entries to the new segment and takes
their ranges out of its fresh allocator. Eviction counts quarantined bytes as free-soon, not
used (`Quarantine.held` per segment, O(1)), and releases due entries before it evicts.

Node tasks on a standby: the leader replicates each task's destination (`apply_task`) and its
end (`apply_task_end`: quarantined here too when it was there); `fence_inflight` quarantines the
destinations of the old leader's tasks still in flight when the standby takes over.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import TYPE_CHECKING, Any

from yuebing.store.master.state import ObjState

if TYPE_CHECKING:
    from yuebing.store.master.allocator import OffsetAllocator
    from yuebing.store.master.core import MasterCore
    from yuebing.store.master.state import Obj, Seg

log = logging.getLogger(__name__)


class Quarantine:
    """Ranges held back from the allocators until a time: a heap of
    ``(until, seq, segment id, offset, size)``, the bytes held per segment id, and the names
    of dropped segments whose entries are not due yet (`orphan` / `adopt`). Entries of a
    dropped segment are never freed into an allocator; they only wait for a re-mount."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._held: dict[int, int] = {}  # segment id -> bytes of its entries
        self._names: dict[int, str] = {}  # dropped segment id -> its name

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, until: float, sid: int, off: int, size: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (until, self._seq, sid, off, size))
        self._held[sid] = self._held.get(sid, 0) + size

    def _forget(self, sid: int, size: int) -> None:
        left = self._held[sid] - size
        if left:
            self._held[sid] = left
        else:
            del self._held[sid]
            self._names.pop(sid, None)

    def release_due(self, now: float, segs: dict[int, Seg]) -> int:
        """Free (into their segments' allocators, where there is one) every range due by
        ``now``; returns how many bytes were released."""
        heap, freed = self._heap, 0
        while heap and heap[0][0] <= now:
            _, _, sid, off, size = heapq.heappop(heap)
            self._forget(sid, size)
            s = segs.get(sid)
            if s is not None and s.alloc is not None:
                s.alloc.free_range(off, size)
                freed += size
        return freed

    def held(self, sid: int) -> int:
        """Bytes held back on segment ``sid`` (`eviction.watermark`: they free themselves)."""
        return self._held.get(sid, 0)

    def bytes(self, segs: dict[int, Seg]) -> int:
        """Bytes held back on segments still mounted (they count as used there)."""
        return sum(n for sid, n in self._held.items() if sid in segs)

    def orphan(self, sid: int, name: str) -> None:
        """Segment ``sid`` (named ``name``) was dropped: keep its entries by name until due."""
        if sid in self._held:
            self._names[sid] = name

    def adopt(self, name: str, sid: int, size: int, alignment: int,
              alloc: OffsetAllocator | None) -> list[tuple[int, int]]:
        """Segment ``name`` is mounted again as ``sid`` (``size`` bytes): the entries kept for
        it since it was dropped move to ``sid`` (clipped to its size, overlaps merged) and,
        given its ``alloc``ator, their ranges are taken out of it. Returns those ranges."""
        old = {o for o, n in self._names.items() if n == name and o != sid}
        if not old:
            return []
        mine = [e for e in self._heap if e[2] in old]
        self._heap = [e for e in self._heap if e[2] not in old]
        heapq.heapify(self._heap)
        for o in old:
            del self._names[o]
            self._held.pop(o, None)
        cap = size - size % alignment
        for until, _, _, off, n in mine:
            if off < cap:
                self.add(until, sid, off, min(n, cap - off))
        held = self.settle(sid, [], alignment)
        if alloc is not None:
            for off, n in held:  # disjoint, inside the capacity: a fresh allocator has them
                taken = alloc.reserve(off, n)
                assert taken, f"quarantined range {off}+{n} of {name!r} is not free"
        return held

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
            if held and held[-1][1] > off:  # overlapping (adjacent ones stay apart)
                held[-1][1] = max(held[-1][1], stop)
                held[-1][2] = max(held[-1][2], until)
            else:
                held.append([off, stop, until])
        self._heap = [e for e in self._heap if e[2] != sid]
        heapq.heapify(self._heap)
        self._held.pop(sid, None)
        for a, b, until in held:
            self.add(until, sid, int(a), int(b - a))
        return [(int(a), int(b - a)) for a, b, _ in held]

    def dump(self, now: float) -> list[list[float | str]]:
        """Entries with times relative to ``now`` (snapshots: clocks differ between hosts);
        an entry of a dropped segment carries the segment's name as a fifth item."""
        out: list[list[float | str]] = []
        for until, _, sid, off, size in self._heap:
            row: list[float | str] = [max(0.0, until - now), sid, off, size]
            if sid in self._names:
                row.append(self._names[sid])
            out.append(row)
        return out

    def load(self, now: float, entries: list[list[Any]]) -> None:
        """Replace every entry with ``entries`` from `dump` (4 or 5 items each)."""
        self._heap.clear()
        self._held.clear()
        self._names.clear()
        for row in entries:
            if len(row) not in (4, 5):
                raise ValueError(f"quarantine entry needs 4 or 5 items, got {row!r}")
            left, sid, off, size = row[:4]
            self.add(now + left, int(sid), int(off), int(size))
            if len(row) == 5:
                self._names[int(sid)] = str(row[4])


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


def release(core: MasterCore, key: str, o: Obj, fenced: bool = True) -> list[str]:
    """Give back the ranges of ``o`` (being dropped by the core): a committed object's at once,
    a pending put's into the quarantine until its fence (at once if that passed already, or
    when not ``fenced``: a reservation its client gave back unused — no write touched it).
    Returns the names of the segments that held it."""
    holders: list[str] = []
    until = 0.0
    now = core.clock.now()
    if fenced and o.state == ObjState.PENDING and o.reps:
        until = _fence_of(core, key, now)
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


def _fence_of(core: MasterCore, key: str, now: float) -> float:
    """When no byte of the pending put ``key`` can land any more: its write expiry (now +
    ``put_timeout_s`` if unknown) + ``write_grace_s`` + ``fence_s``."""
    expiry = core.expiry.get(key, now + core.cfg.put_timeout_s)
    return expiry + core.cfg.write_grace_s + core.cfg.fence_s


def segment_dropped(core: MasterCore, s: Seg, pending: list[tuple[str, int, int]]) -> None:
    """``segments.drop_segment`` dropped ``s``: the ranges ``(key, offset, size)`` that pending
    puts held on it are quarantined until their fence (their writers may still be sending),
    and every entry of ``s`` is kept by its name for a re-mount (`Quarantine.adopt`)."""
    now = core.clock.now()
    for key, off, size in pending:
        until = _fence_of(core, key, now)
        if until > now:
            core.quarantine.add(until, s.id, off, size)
    core.quarantine.orphan(s.id, s.name)
    if core.quarantine.held(s.id):
        log.info("segment %s dropped with %d quarantined bytes; kept for a re-mount", s.name,
                 core.quarantine.held(s.id))


# ------------------------------------------------------------------ standby: node tasks in flight
def apply_task(core: MasterCore, e: list) -> None:
    """Standby: the leader pushed a task writing ``e`` = [_, id, segment, offset, size,
    expires_in_s]; its write expiry is taken late (from now, when the entry arrives)."""
    _, tid, sid, off, size, window = e
    core.drains.inflight[tid] = (sid, off, size, core.clock.now() + window)


def apply_task_end(core: MasterCore, e: list) -> None:
    """Standby: the leader's task ``e[1]`` ended; ``e[2]``: its destination was quarantined
    there (a failed or lost migration), so it is here too."""
    ent = core.drains.inflight.pop(e[1], None)
    if ent is not None and e[2]:
        sid, off, size, until = ent
        core.quarantine.add(until + core.cfg.write_grace_s + core.cfg.fence_s, sid, off, size)


def fence_inflight(core: MasterCore) -> int:
    """`replication.take_over`: quarantine the destinations of the old leader's tasks in flight
    (its nodes may still write there) until their write expiry + ``write_grace_s`` +
    ``fence_s``; returns how many."""
    now = core.clock.now()
    late = core.cfg.write_grace_s + core.cfg.fence_s
    n = 0
    for sid, off, size, until in core.drains.inflight.values():
        if sid in core.segs:
            core.quarantine.add(max(until, now) + late, sid, off, size)
            n += 1
    core.drains.inflight.clear()
    return n
