"""The write fence: space of a put that ended without a commit is not reused until no byte of
that put can still land in it. `WriteFence` owns each pending put's write expiry (returned to
the client as ``expires_in_s``; targets refuse writes after it plus ``write_grace_s``), the
`Quarantine` of ranges held back until expiry + ``write_grace_s`` + ``fence_s``, and a
standby's copy of the leader's node-task destinations (`inflight`, quarantined at takeover).
`Objects.drop` gives ranges back through `release`; `Membership` fences an unmounted segment
(`segment_dropped`; a re-mount by name adopts its entries); `Tasks` quarantines a failed task's
destination; the tick frees due entries; `Eviction` counts them as free soon, not used.
"""

from __future__ import annotations

import bisect
import heapq
import logging
from typing import Any

from yuebing.core.clock import Clock
from yuebing.store.config import MasterConfig
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.effects import Effects
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import Obj, ObjState, Seg

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
        """Bytes held back on segment ``sid`` (`Eviction.watermark`: they free themselves)."""
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
        before an allocator rebuild (`Replication.take_over`), and return the ranges they hold.
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


class WriteFence:
    """``expiry`` (key -> write expiry of each pending put, the master's clock), the
    ``quarantine`` and, on a standby, ``inflight`` (the leader's task id -> destination
    segment, offset, size, write expiry)."""

    __slots__ = ("cfg", "clock", "effects", "expiry", "inflight", "quarantine", "segments")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.effects = effects
        self.expiry: dict[str, float] = {}
        self.quarantine = Quarantine()
        self.inflight: dict[int, tuple[int, int, int, float]] = {}

    def write_expiry(self, now: float, requested_s: float) -> float:
        """When the put started ``now`` must stop writing: the shorter of ``put_timeout_s`` and
        the client's requested transfer timeout (0 = none requested)."""
        limit = self.cfg.put_timeout_s
        return now + (min(limit, requested_s) if requested_s > 0 else limit)

    def expires_in(self, keys: list[str]) -> float:
        """Seconds from now until the earliest write expiry of the pending puts ``keys`` (what
        `PutTargets` / `BatchPutTargets` return; 0 if it passed already)."""
        now = self.clock.now()
        expiry = self.expiry
        ends = [expiry[k] for k in keys if k in expiry]
        return max(0.0, min(ends) - now) if ends else 0.0

    def start(self, key: str, now: float, requested_s: float) -> None:
        """The put of ``key`` started ``now``: record its write expiry (`write_expiry`)."""
        self.expiry[key] = self.write_expiry(now, requested_s)

    def set(self, key: str, until: float) -> None:
        """Record ``until`` as the write expiry of ``key`` (standby entries, takeover)."""
        self.expiry[key] = until

    def forget(self, key: str) -> None:
        """``key`` committed: no write of it can land after its commit."""
        self.expiry.pop(key, None)

    def forget_all(self) -> None:
        """Every pending put is gone (a standby loading a snapshot)."""
        self.expiry.clear()

    def rename(self, name: str, key: str) -> None:
        """A reservation ``name`` became the put of ``key``: its write expiry moves along."""
        if name in self.expiry:
            self.expiry[key] = self.expiry.pop(name)

    def release(self, key: str, o: Obj, fenced: bool = True) -> list[str]:
        """Give back the ranges of ``o`` (being dropped): a committed object's at once, a
        pending put's into the quarantine until its fence (at once if that passed already, or
        when not ``fenced``: a reservation its client gave back unused — no write touched it).
        Returns the names of the segments that held it."""
        holders: list[str] = []
        until = now = 0.0
        if fenced and o.state == ObjState.PENDING and o.reps:  # a committed one: no clock read
            now = self.clock.now()
            until = self.fence_of(key, now)
        segs = self.segments.segs
        for sid, off in o.reps:
            s = segs.get(sid)
            if s is None:
                continue
            holders.append(s.name)
            if until > now:
                self.quarantine.add(until, sid, off, o.size)
            elif s.alloc is not None:
                s.alloc.free_range(off, o.size)
        if until > now:
            self.effects.counters["quarantined"] += 1
            log.info("put %s ended uncommitted: %d range(s) quarantined for %.2fs", key,
                     len(holders), until - now)
        self.expiry.pop(key, None)
        return holders

    def fence_of(self, key: str, now: float) -> float:
        """When no byte of the pending put ``key`` can land any more: its write expiry (now +
        ``put_timeout_s`` if unknown) + ``write_grace_s`` + ``fence_s``."""
        expiry = self.expiry.get(key, now + self.cfg.put_timeout_s)
        return expiry + self.cfg.write_grace_s + self.cfg.fence_s

    def task_failed(self, until: float, s: Seg, off: int, size: int) -> None:
        """A node task writing ``s`` at ``off`` ended without a copy while its writes may still
        land: quarantine the range until ``until`` (`Tasks.end`)."""
        self.quarantine.add(until, s.id, off, size)
        self.effects.counters["quarantined"] += 1

    def segment_dropped(self, s: Seg, pending: list[tuple[str, int, int]]) -> None:
        """``s`` was unmounted: the ranges ``(key, offset, size)`` that pending puts held on it
        are quarantined until their fence (their writers may still be sending), and every
        entry of ``s`` is kept by its name for a re-mount (`Quarantine.adopt`)."""
        now = self.clock.now()
        q = self.quarantine
        for key, off, size in pending:
            until = self.fence_of(key, now)
            if until > now:
                q.add(until, s.id, off, size)
        q.orphan(s.id, s.name)
        if q.held(s.id):
            log.info("segment %s dropped with %d quarantined bytes; kept for a re-mount",
                     s.name, q.held(s.id))

    def segment_mounted(self, name: str, sid: int, size: int,
                        alloc: OffsetAllocator | None) -> None:
        """Segment ``name`` is mounted (again) as ``sid``: its fence comes back with it."""
        self.quarantine.adopt(name, sid, size, self.cfg.alignment, alloc)

    # -------------------------------------------------------------- standby: node tasks in flight
    def apply_task(self, e: list) -> None:
        """Standby: the leader pushed a task writing ``e`` = [_, id, segment, offset, size,
        expires_in_s]; its write expiry is taken late (from now, when the entry arrives)."""
        _, tid, sid, off, size, window = e
        self.inflight[tid] = (sid, off, size, self.clock.now() + window)

    def apply_task_end(self, e: list) -> None:
        """Standby: the leader's task ``e[1]`` ended; ``e[2]``: its destination was quarantined
        there (a failed or lost migration), so it is here too."""
        ent = self.inflight.pop(e[1], None)
        if ent is not None and e[2]:
            sid, off, size, until = ent
            self.quarantine.add(until + self.cfg.write_grace_s + self.cfg.fence_s, sid, off, size)

    def fence_inflight(self) -> int:
        """At takeover: quarantine the destinations of the old leader's tasks in flight (its
        nodes may still write there) until their write expiry + ``write_grace_s`` +
        ``fence_s``; returns how many."""
        now = self.clock.now()
        late = self.cfg.write_grace_s + self.cfg.fence_s
        segs = self.segments.segs
        n = 0
        for sid, off, size, until in self.inflight.values():
            if sid in segs:
                self.quarantine.add(max(until, now) + late, sid, off, size)
                n += 1
        self.inflight.clear()
        return n
