"""Eviction and the DRAM->SSD tier: `Eviction` makes room, approximately in LRU order.

Triggers: `watermark` (tick: DRAM use above ``high_watermark``, quarantined ranges not counted,
evicts down to ``high_watermark - evict_ratio``), `room_for` (an allocation failed: one
contiguous range of the size on one segment, the window `fit` picks), `keep_fit` (tick: keeps a
free range of a size that lately found none) and the `drain` pass (drops redundant replicas on
draining segments once no reader may hold them). A DRAM victim whose value has no other copy is
offloaded to its node's SSD tier when there is one (a `Tasks` OFFLOAD). Leased, hard-pinned and
moving values are never evicted; soft pins last. Called by `Puts` (`place`), `Tiers` (room to
promote) and the tick.
"""

from __future__ import annotations

import logging

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind, TaskKind
from yuebing.store.config import MasterConfig
from yuebing.store.master import fit
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.fit import Room
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import ObjState, SegState
from yuebing.store.master.tasks import Tasks

log = logging.getLogger(__name__)
SCAN_LIMIT = 200_000
FIT_MEMORY_S = 10.0
"""How long `keep_fit` keeps room for a size that once found none."""


class Eviction:
    """``fit_size``: the largest size that lately found no room, remembered until
    ``fit_until`` (`keep_fit`)."""

    __slots__ = ("cfg", "clock", "effects", "fence", "fit_size", "fit_until", "migrations",
                 "objects", "segments", "tasks")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, objects: Objects,
                 tasks: Tasks, fence: WriteFence, migrations: Migrations,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.objects = objects
        self.tasks = tasks
        self.fence = fence
        self.migrations = migrations
        self.effects = effects
        self.fit_size = 0
        self.fit_until = 0.0

    # -------------------------------------------------------------- the watermark
    def watermark(self) -> int:
        """Evict (offloading where possible) when DRAM usage, not counting quarantined
        ranges, passes the high watermark. Called by the tick."""
        cap = used = 0
        q = self.fence.quarantine
        for s in self.segments.segs.values():
            if s.tier == 0 and s.alloc is not None:
                cap += s.alloc.capacity
                used += s.alloc.used - q.held(s.id)
        in_flight = self.tasks.offloading()
        if not cap or used - in_flight <= self.cfg.high_watermark * cap:
            return 0
        target = (self.cfg.high_watermark - self.cfg.evict_ratio) * cap
        return self.evict_for(int(used - in_flight - target), offload=True)

    def evict_for(self, need: int, only: set[int] | None = None, tier: int = 0,
                  offload: bool = False) -> int:
        """Free at least ``need`` bytes of ``tier`` (on segments ``only``, if given) in LRU
        order, wherever they are: quarantined ranges due by now first, then by eviction.
        Returns the bytes freed or scheduled to be freed by offloads."""
        freed = self._release_due(only, tier)
        for soft_ok in (False, True):
            if freed >= need:
                break
            freed += self._scan(need - freed, only, tier, offload, soft_ok)
        if freed:
            log.info("freed %d bytes (needed %d, tier %d)", freed, need, tier)
        return freed

    def _release_due(self, only: set[int] | None, tier: int) -> int:
        """Release every quarantined range due by now; returns the bytes released on ``tier``
        (segments ``only``, if given)."""
        q = self.fence.quarantine
        segs = self.segments.segs
        mine = [sid for sid, s in segs.items()
                if s.tier == tier and (only is None or sid in only)]
        before = sum(q.held(sid) for sid in mine)
        if not before:
            return 0
        q.release_due(self.clock.now(), segs)
        return before - sum(q.held(sid) for sid in mine)

    def _victims(self, only: set[int] | None, tier: int, soft_ok: bool):
        now = self.clock.now()
        segs = self.segments.segs
        n = 0
        for key, o in self.objects.objs.items():
            n += 1  # held values count too: they cannot make the walk unbounded
            if n > SCAN_LIMIT:
                return
            if not o.reps:  # on no segment (a value the master holds, `Inline`)
                continue
            if (o.state != ObjState.COMMITTED or o.lease > now or o.pin or o.moving
                    or (not soft_ok and o.soft > now)):
                continue
            mine = [r for r in o.reps
                    if segs[r[0]].tier == tier and (only is None or r[0] in only)]
            if mine:
                yield key, o, mine

    def _scan(self, need: int, only: set[int] | None, tier: int, offload: bool,
              soft_ok: bool) -> int:
        picked: list[tuple[str, int]] = []
        total = 0
        for key, o, mine in self._victims(only, tier, soft_ok):
            if total >= need:
                break
            picked.append((key, o.size))
            total += o.size * len(mine)
        freed = 0
        segs = self.segments.segs
        objs = self.objects.objs
        for key, _ in picked:  # act after the scan: making SSD room mutates the object dict
            o = objs.get(key)
            if o is None or o.moving:
                continue
            mine = [r for r in o.reps
                    if segs[r[0]].tier == tier and (only is None or r[0] in only)]
            if not mine:
                continue
            if tier == 0 and offload and len(mine) == len(o.reps) and any(  # through any replica
                    self.offload_to_ssd(key, r) for r in mine):  # whose node has SSD room
                freed += o.size
                continue
            self.drop_replicas(key, mine)
            freed += o.size * len(mine)
        return freed

    # -------------------------------------------------------------- draining segments
    def drain(self) -> int:
        """Drop the replicas on draining segments of values that keep one elsewhere and that no
        reader may still hold (`Migrations.redundant`); returns the bytes freed. Called every
        tick, only while a draining segment still holds something."""
        segs = self.segments.segs
        draining = [s.id for s in segs.values()
                    if s.state == SegState.DRAINING and s.alloc is not None and s.alloc.used]
        if not draining:
            return 0
        picked = self.migrations.redundant(draining, self.clock.now())
        objs = self.objects.objs
        freed = sum(objs[key].size * len(mine) for key, mine in picked.items())
        for key, mine in picked.items():  # act after the scan: dropping mutates the sets
            self.drop_replicas(key, mine)
        return freed

    # -------------------------------------------------------------- one contiguous range
    def room_for(self, size: int, sids: list[int], offload: bool = True) -> Room:
        """Make one free range of ``size`` bytes on one of segments ``sids`` (one tier):
        release the quarantined ranges due by now, then `make_room` if still none fits."""
        segs = self.segments.segs
        if not sids:
            return Room.NONE
        tier = segs[sids[0]].tier

        def fits() -> bool:
            return any((a := segs[s].alloc) is not None and a.largest_free >= a.rounded(size)
                       for s in sids)

        if self._release_due(set(sids), tier) and fits():
            return Room.NOW
        return self.make_room(size, sids, offload)

    def make_room(self, size: int, sids: list[int], offload: bool = True) -> Room:
        """Free one range of ``size`` bytes on one of segments ``sids`` (all of one tier): the
        cheapest window (`fit`). Evicts only the values in that window; WAIT when offloads or
        read leases ending free it later, NONE when no window exists (nothing evicted)."""
        segs = self.segments.segs
        sids = [s for s in sids if segs[s].alloc is not None]
        if not sids:
            return Room.NONE
        now = self.clock.now()
        layout = fit.pieces(segs, self.objects.objs, self.tasks.tasks, sids, now,
                            now + self.cfg.room_wait_s)
        best = fit.cheapest(layout, segs, sids, size)
        if best is None:
            return Room.NONE
        sid, window = best
        if any(p.kind == fit.LATER for p in window):
            return Room.WAIT  # evict nothing yet: the leases end first
        waiting = any(p.kind == fit.SOON for p in window)
        for p in window:
            if p.kind == fit.VICTIM:
                waiting |= self._evict(p.key, (sid, p.start), offload)
        return Room.WAIT if waiting else Room.NOW

    def _evict(self, key: str, rep: tuple[int, int], offload: bool) -> bool:
        """Free ``key``'s replica ``rep``: dropped when the value keeps another replica (or
        cannot be offloaded), else offloaded to its node's SSD tier. Returns True when the
        range frees later (an offload started)."""
        o = self.objects.objs.get(key)
        if o is None or rep not in o.reps or o.moving:
            return False
        s = self.segments.segs[rep[0]]
        if (offload and s.tier == m.Tier.DRAM and len(o.reps) == 1
                and self.offload_to_ssd(key, rep)):
            return True
        self.drop_replicas(key, [rep])
        return False

    def place(self, client: str, it: m.PutItem, need: int) -> tuple[list[tuple[int, int]], bool]:
        """Place ``it`` (at least ``need`` replicas) after its first try found no room: make
        one range of room per missing replica (`room_for` on the active DRAM segments that
        have none), placing again after each. Returns the placement, or [] and whether room is
        on its way (offloads, leases ending)."""
        self.note_size(it.size)
        segs = self.segments
        for _ in range(need):
            short = [s.id for s in segs.segs.values() if s.tier == m.Tier.DRAM
                     and s.state == SegState.ACTIVE and s.alloc is not None
                     and s.alloc.largest_free < s.alloc.rounded(it.size)]
            got = self.room_for(it.size, short)
            if got != Room.NOW:
                return [], got == Room.WAIT
            placed = segs.place(client, it, need)
            if placed:
                return placed, False
        return [], False

    # -------------------------------------------------------------- one victim
    def offload_to_ssd(self, key: str, src: tuple[int, int]) -> bool:
        """Start offloading ``key``'s DRAM replica ``src`` to its node's SSD tier, making one
        contiguous range of room there (dropping SSD-tier values) when none is free; False
        when the node has no active SSD tier or no room can be made."""
        o = self.objects.objs[key]
        dst = self.segments.of_node(self.segments.segs[src[0]].node, m.Tier.SSD)
        if dst is None:
            return False
        if self.tasks.copy(key, o, src, dst, promote=False):
            return True
        return (self.room_for(o.size, [dst.id], offload=False) == Room.NOW
                and self.tasks.copy(key, o, src, dst, promote=False))

    def drop_replicas(self, key: str, mine: list[tuple[int, int]]) -> None:
        o = self.objects.objs[key]
        self.effects.counters["evictions"] += 1
        if len(mine) == len(o.reps):
            self.objects.drop(key, o)
            return
        segs = self.segments.segs
        for sid, off in mine:
            alloc = segs[sid].alloc
            if alloc is not None:
                alloc.free_range(off, o.size)
        o.reps = tuple(r for r in o.reps if r not in mine)
        self.migrations.recheck(key, o)  # its surviving replicas may all be draining now
        self.effects.events.append((EventKind.REMOVED, key, [segs[sid].name for sid, _ in mine]))
        self.effects.entry(["reps", key, o.reps])

    # -------------------------------------------------------------- keeping a fit
    def note_size(self, size: int) -> None:
        """Remember a size that found no room (`keep_fit` keeps room for the largest
        lately)."""
        now = self.clock.now()
        if size >= self.fit_size or now >= self.fit_until:
            self.fit_size = size
        self.fit_until = now + FIT_MEMORY_S

    def keep_fit(self) -> None:
        """Every tick: when no active DRAM segment has a free range of the largest size that
        found no room lately, make one on a segment whose free bytes are at least twice that
        size — free space that fragmentation made useless, not space the watermark leaves in
        use — so the next put of that size does not wait for its own eviction."""
        size = self.fit_size
        if not size:
            return
        if self.clock.now() >= self.fit_until:
            self.fit_size = 0
            return
        dram = [s for s in self.segments.segs.values() if s.tier == m.Tier.DRAM
                and s.state == SegState.ACTIVE and s.alloc is not None]
        if not dram or any(t.kind == TaskKind.OFFLOAD for t in self.tasks.tasks.values()):
            return  # none, or room is on its way
        if any(s.alloc.largest_free >= s.alloc.rounded(size) for s in dram):  # type: ignore[union-attr]
            return
        loose = [s.id for s in dram if s.alloc.free >= 2 * s.alloc.rounded(size)]  # type: ignore[union-attr]
        if loose:
            self.make_room(size, loose)
