"""Drain migrations: `Migrations` makes sure a draining segment loses no committed value while
the rest of the cluster has room.

A value is *at risk* when every replica lies on a DRAINING segment. `refresh` (each `Drain`
request, repeated by the waiting node) counts a segment's at-risk values and queues them, then
counts the values a reader still leases there; `pump` (after a `Drain`, every tick, when a
migration ends) starts up to ``drain_parallel`` MIGRATE tasks to ACTIVE DRAM segments, retried
elsewhere after a failure (at most `MAX_ATTEMPTS`). The per-segment *risk* / *spare* key sets
(`index`, one walk per drain start) keep that work off the object table. Not replicated: a
new leader rebuilds it from the nodes' repeated `Drain`s. Called by `Membership`, `Tiers`,
`Reads`, `Eviction` (its drain pass) and the tick.
"""

from __future__ import annotations

import logging
import random

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import TaskKind
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.leases import Leases
from yuebing.store.master.objects import Objects
from yuebing.store.master.placement import PlacementRequest, free_ratio_first
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import Obj, ObjState, Seg, SegState, Task
from yuebing.store.master.tasks import Tasks

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
MIGRATE = TaskKind.MIGRATE
DRAINING = SegState.DRAINING
WALK_ALWAYS = 20_000
"""A risk set up to this size is walked on every `Drain` (a few ms)."""


def _walk_every(n: int) -> float:
    """Seconds between walks of a risk set of ``n`` keys (~2 us each): at most ~5% of a core
    however often the node asks."""
    return max(0.5, n * 2e-6 * 20)


def _on(o: Obj, sid: int) -> bool:
    return any(r[0] == sid for r in o.reps)


class Migrations:
    """``queue``: an ordered set of keys waiting for a migration (``min_size``: the smallest
    value queued, 0 when empty); ``tried``: key -> destination segments whose migration
    failed; ``risk`` / ``spare``: draining segment -> its keys at risk / with a replica
    elsewhere (``dirty``: rebuild them; ``walked``: when `refresh` last walked each risk set);
    ``since``: draining segment -> when its drain started (the master's clock)."""

    __slots__ = ("cfg", "clock", "dirty", "effects", "leases", "min_size", "objects", "queue",
                 "rng", "risk", "segments", "since", "spare", "tasks", "tried", "walked")

    def __init__(self, cfg: MasterConfig, clock: Clock, rng: random.Random, segments: Segments,
                 objects: Objects, tasks: Tasks, leases: Leases, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.rng = rng
        self.segments = segments
        self.objects = objects
        self.tasks = tasks
        self.leases = leases
        self.effects = effects
        self.reset()

    def reset(self) -> None:
        """Forget every drain (a standby loading a snapshot: a stale index would skip values
        now at risk)."""
        self.queue: dict[str, None] = {}
        self.min_size = 0
        self.tried: dict[str, set[int]] = {}
        self.risk: dict[int, set[str]] = {}
        self.spare: dict[int, set[str]] = {}
        self.walked: dict[int, float] = {}
        self.dirty = False
        self.since: dict[int, float] = {}

    # -------------------------------------------------------------- segments
    def begin(self, sid: int, now: float) -> None:
        """Segment ``sid`` started draining at ``now`` (or counts as such: a new leader)."""
        self.since[sid] = now

    def segment_dropped(self, sid: int) -> None:
        """Segment ``sid`` was unmounted: values with a replica there may be at risk now (the
        index is rebuilt before its next use)."""
        self.since.pop(sid, None)
        if not self.since:  # no drain left: forget the hand-outs noted for them
            self.leases.forget_handouts()
        self.dirty = True

    # -------------------------------------------------------------- readers
    def dram_replicas(self, o: Obj, key: str | None = None) -> list[m.Replica]:
        """The DRAM replicas a reader of ``o`` is given (`Reads`, promotions): those on
        draining segments only when it has no other, so a hot value does not hold a drain up;
        giving one out is noted under ``key`` (see `reader_may_hold`)."""
        segs = self.segments.segs
        reps = [(segs[s], off) for s, off in o.reps if segs[s].tier == 0]
        for sg, _ in reps:
            if sg.state == DRAINING:
                active = [r for r in reps if r[0].state != DRAINING]
                if active:
                    reps = active
                elif key is not None:
                    self.leases.hand_out(key, o.lease)
                break
        return [m.Replica(segment=sg.name, offset=off) for sg, off in reps]

    def keep_lease(self, key: str, o: Obj) -> None:
        """`Reads` is about to overwrite ``o``'s running lease while a drain runs (it calls
        this only then): when that lease was granted before a segment holding one of ``o``'s
        replicas began draining, its reader was given every replica, so the lease is noted as
        a hand-out before it is forgotten and `reader_may_hold` still counts that reader.
        O(replicas)."""
        granted = o.lease - self.cfg.lease_ttl_s
        for sid, _ in o.reps:
            since = self.since.get(sid)
            if since is not None and granted <= since:
                self.leases.keep_handout(key, o.lease)
                return

    def reader_may_hold(self, key: str, o: Obj, sid: int, now: float) -> bool:
        """Whether a reader may still be copying ``o``'s replica on draining segment ``sid``:
        one was handed it during the drain and its lease runs, or ``o``'s lease was granted
        before the drain started (then every replica was given out). A lease granted later,
        with no hand-out noted, named only replicas elsewhere: it does not hold the draining
        one."""
        if self.leases.handed_running(key, now):
            return True
        if o.lease <= now:
            return False
        since = self.since.get(sid)
        return since is None or o.lease - self.cfg.lease_ttl_s <= since

    # -------------------------------------------------------------- the risk / spare index
    def at_risk(self, o: Obj) -> bool:
        """True when unmounting the draining segments would leave ``o`` without a replica."""
        segs = self.segments.segs
        return bool(o.reps) and all(segs[sid].state == DRAINING for sid, _ in o.reps)

    def index(self) -> None:
        """(Re)build ``risk`` / ``spare`` when a segment started draining or one was dropped
        since the last build: one walk over the objects (rare; nothing else walks them all)."""
        draining = {sid for sid, s in self.segments.segs.items() if s.state == DRAINING}
        if not self.dirty and draining == self.risk.keys():
            return
        self.dirty = False
        self.walked.clear()
        self.risk = {sid: set() for sid in draining}
        self.spare = {sid: set() for sid in draining}
        if not draining:
            return
        for key, o in self.objects.objs.items():
            mine = [sid for sid, _ in o.reps if sid in draining]
            if mine:
                into = self.risk if len(mine) == len(o.reps) else self.spare
                for sid in mine:
                    into[sid].add(key)

    def recheck(self, key: str, o: Obj) -> None:
        """``o`` lost a replica (eviction): file it as at risk on its draining segments if it
        is now. Called by `Eviction.drop_replicas`."""
        if self.risk and self.at_risk(o):
            for sid, _ in o.reps:
                if sid in self.risk:
                    self.risk[sid].add(key)
                    self.spare[sid].discard(key)

    def file_key(self, key: str, o: Obj) -> None:
        """``o`` gained a replica (a tier task or a migration landed): file ``key`` under each
        draining segment it is on, as *risk* or *spare*, so the drain counts it (a segment may
        have begun draining while the task ran, after the index was built). O(replicas)."""
        if not self.risk:
            return
        into, other = (self.risk, self.spare) if self.at_risk(o) else (self.spare, self.risk)
        for sid, _ in o.reps:
            if sid in into:
                into[sid].add(key)
                other[sid].discard(key)

    def refresh(self, sid: int) -> tuple[int, int]:
        """Queue the committed at-risk values with a replica on draining segment ``sid``;
        return how many values (pending ones included: they would be lost too) are at risk
        there and, once none is, how many there a reader still leases (-1 while some are at
        risk). Walks the risk set after an index build, while it is small, or once
        `_walk_every` passed; between walks its size is the count (migrations take keys out at
        once; a key dropped meanwhile is counted until the next walk, which only makes the
        node wait longer)."""
        self.index()
        risk, spare = self.risk.get(sid), self.spare.get(sid)
        if risk is None or spare is None:
            return 0, 0
        now = self.clock.now()
        if len(risk) > WALK_ALWAYS and now < self.walked.get(sid, 0.0) + _walk_every(len(risk)):
            return len(risk), -1
        self.walked[sid] = now
        objs, segs, n, gone = self.objects.objs, self.segments.segs, 0, []
        queue, tried = self.queue, self.tried
        for key in risk:
            o = objs.get(key)
            if o is None:
                gone.append(key)
                continue
            reps = o.reps
            if len(reps) == 1:  # the common case, without generators
                if reps[0][0] != sid:
                    gone.append(key)
                    continue
            elif not any(r[0] == sid for r in reps):
                gone.append(key)
                continue
            elif not all(segs[r[0]].state == DRAINING for r in reps):
                gone.append(key)
                spare.add(key)
                continue
            n += 1
            if (o.state == ObjState.COMMITTED and not o.moving and key not in queue
                    and len(tried.get(key, ())) < MAX_ATTEMPTS):
                queue[key] = None
                self.min_size = min(self.min_size, o.size) if self.min_size else o.size
        risk.difference_update(gone)
        if n:
            return n, -1
        leased, gone = 0, []
        for key in spare:
            o = objs.get(key)
            if o is None or not any(r[0] == sid for r in o.reps):
                gone.append(key)
            elif self.reader_may_hold(key, o, sid, now):
                leased += 1
        spare.difference_update(gone)
        return 0, leased

    def redundant(self, draining: list[int], now: float) -> dict[str, list[tuple[int, int]]]:
        """The replicas on ``draining`` segments that may be dropped now, by key: the value keeps
        a replica elsewhere, is committed and not moving, and no reader may hold them
        (`reader_may_hold`). Walks only the spare sets, pruning keys that left."""
        self.index()
        objs, segs = self.objects.objs, self.segments.segs
        picked: dict[str, list[tuple[int, int]]] = {}
        for sid in draining:
            spare = self.spare.get(sid)
            if not spare:
                continue
            gone = []
            for key in spare:
                o = objs.get(key)
                if o is None or not any(r[0] == sid for r in o.reps):
                    gone.append(key)
                    continue
                if (o.state != ObjState.COMMITTED or o.moving or key in picked
                        or self.reader_may_hold(key, o, sid, now)):
                    continue
                mine = [r for r in o.reps if segs[r[0]].state == DRAINING
                        and not self.reader_may_hold(key, o, r[0], now)]
                if len(mine) < len(o.reps):
                    picked[key] = mine
            spare.difference_update(gone)
        return picked

    # -------------------------------------------------------------- migrations
    def pump(self) -> int:
        """Start queued migrations while fewer than ``drain_parallel`` are in flight; returns
        how many were started. Returns at once when no ACTIVE DRAM segment has room for the
        smallest queued value."""
        if not self.queue:
            self.min_size = 0
            if self.tried and not any(s.state == DRAINING for s in self.segments.segs.values()):
                self.tried.clear()
            return 0
        busy = self.tasks.count(MIGRATE)
        room = self.segments.largest_free()
        align = self.cfg.alignment
        parallel = self.cfg.drain_parallel
        if busy >= parallel or room < -(-self.min_size // align) * align:
            return 0
        started = 0
        smallest = 0
        objs = self.objects.objs
        for key in list(self.queue):
            if busy >= parallel:
                smallest = 0  # not every entry seen: keep the old bound
                break
            o = objs.get(key)
            if o is None or not self.at_risk(o) or len(self.tried.get(key, ())) >= MAX_ATTEMPTS:
                del self.queue[key]
                continue
            fits = -(-o.size // align) * align <= room
            if o.state == ObjState.COMMITTED and not o.moving and fits and self.start(key, o):
                del self.queue[key]
                busy += 1
                started += 1
                room = self.segments.largest_free()
                continue
            smallest = min(smallest, o.size) if smallest else o.size  # a tier move, or no room
        else:
            self.min_size = smallest  # every entry seen: the exact bound (0: the queue is empty)
        return started

    def _destination(self, o: Obj, src: Seg, avoid: set[int]) -> tuple[Seg, int] | None:
        held = {sid for sid, _ in o.reps}
        cands = []
        for s in self.segments.segs.values():
            if (s.tier == m.Tier.DRAM and s.state == SegState.ACTIVE and s.alloc is not None
                    and s.id not in held and s.id not in avoid
                    and s.alloc.largest_free >= s.alloc.rounded(o.size)):
                cands.append(s)
        ordered = free_ratio_first(cands, PlacementRequest(o.size), self.rng)
        ordered.sort(key=lambda s: s.node == src.node)  # stable: other nodes first
        for s in ordered:
            off = s.alloc.alloc(o.size)  # type: ignore[union-attr]
            if off is not None:
                return s, off
        return None

    def start(self, key: str, o: Obj) -> bool:
        """Allocate a destination for ``o`` (at risk, or an SSD-only value whose node has no
        ACTIVE DRAM segment: `Tiers.promote`) and push the task; False when no room."""
        segs = self.segments.segs
        src = min(o.reps, key=lambda r: segs[r[0]].tier)  # a DRAM replica when there is one
        src_seg = segs[src[0]]
        found = self._destination(o, src_seg, self.tried.get(key, set()))
        if found is None:
            log.debug("no room to migrate %s off %s", key, src_seg.name)
            return False
        dst, off = found
        self.tasks.push(key, o, src, dst, off, MIGRATE, src_seg.client)
        self.effects.counters["migrations_started"] += 1
        log.info("migrating %s (%d bytes) from %s %s to %s", key, o.size,
                 src_seg.state.name.lower(), src_seg.name, dst.name)
        return True

    def finished(self, t: Task, o: Obj) -> None:
        """A migration's TaskDone(ok): the destination becomes a replica (the caller removed
        the task and cleared ``o.moving``)."""
        o.reps = (t.dst, *o.reps)
        self.tried.pop(t.key, None)
        self.file_key(t.key, o)  # spare now (unless its destination began draining meanwhile):
        self.effects.counters["migrations_done"] += 1  # eviction may drop the old replica
        if t.waiters:  # readers of an SSD-only value asked while it moved: answer from the copy
            lid = self.leases.grant(t.key, o, len(t.waiters))
            reply = m.ReplicaList(key=t.key, size=o.size, checksum=o.checksum,
                                  replicas=self.dram_replicas(o, t.key),
                                  lease_s=self.cfg.lease_ttl_s, lease_id=lid)
            self.effects.ready.extend((w, reply) for w in t.waiters)
        self.pump()

    def failed(self, t: Task, why: str) -> None:
        """A migration failed or its destination went away (the destination range was
        quarantined): queue the value again, avoiding that destination, or give it up."""
        o = self.objects.objs.get(t.key)
        if o is None or not self.at_risk(o):
            return
        self.effects.counters["migrations_failed"] += 1
        tried = self.tried.setdefault(t.key, set())
        tried.add(t.dst[0])
        if len(tried) >= MAX_ATTEMPTS:
            self.effects.counters["migrations_given_up"] += 1
            log.warning("gave up migrating %s after %d failed attempts (last: %s); it is lost "
                        "when its draining segment is unmounted", t.key, len(tried), why)
            return
        log.warning("migration of %s failed (%s); trying another destination", t.key, why)
        self.queue[t.key] = None  # started again by the next pump (tick), not from here
        self.min_size = min(self.min_size, o.size) if self.min_size else o.size
