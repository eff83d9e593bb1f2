"""Drain migrations of the master core: a draining segment loses no committed value while the
rest of the cluster has room.

A value is *at risk* when every replica it has lies on a DRAINING segment (its sole copy is
there, or its other copies are on segments draining too): unmounting would lose it. ``refresh``
(called by each `Drain` request, which the node repeats while it waits) counts the at-risk
values of a segment and queues the committed ones; once none is left it counts the values a
reader still leases there (the node waits for both). ``pump`` (after each `Drain`, on every
tick and when a migration ends) starts up to ``drain_parallel`` migrations. A migration
allocates a range on an ACTIVE DRAM segment chosen like a put's placement (free ratio, not a
segment the value is already on, another node first) and pushes a MIGRATE `NodeTask` to the
node owning the source replica (a DRAM replica preferred; an SSD-only value is read from the
owner's file); the node writes the bytes with its transfer engine and answers `TaskDone`. On
success the new replica is added (first, so new readers use it; a STORED event; a ``reps``
replication entry so a standby taking over keeps it) while the draining replica stays for
readers holding leases until eviction's drain pass or the unmount drops it. On failure the
destination range is quarantined (`fence`: frames may still land until the task's write expiry
+ ``write_grace_s`` + ``fence_s``) and the value is queued again, avoiding the destinations
that failed, at most ``MAX_ATTEMPTS`` times; then it is given up with a log line (it stays in
the `Drain` count). A value without room anywhere stays queued (room may appear) and counted.
Leases, pins and soft pins live on the object, so they move with it. Only DRAM segments are
destinations: an SSD tier is a node-local file that no transfer engine can write remotely; the
destination node's watermark eviction may offload the copy to its own SSD later.

Cost: no hot path (put, get) pays anything while no drain runs (a get checks that ``since`` is
empty; during a drain, a get renewing a running lease calls `keep_lease`, O(replicas), so a
reader from before the drain is not forgotten). When a segment starts draining (or one is dropped)
``index`` walks the objects once and files each key with a replica on a draining segment under
that segment, as *risk* (at risk) or *spare* (a replica elsewhere survives); later work walks
only those sets, pruning keys that left: ``refresh`` its segment's risk set (and spare set for
the lease count), eviction's drain pass the spare sets. A key becomes at risk again only when
another segment starts draining or is dropped (a new index) or eviction drops its surviving
replica (`recheck`); a task that lands a replica files it under the draining segments it is on
(`file_key`: a segment may have begun draining while the task ran). ``pump`` returns at once
when no ACTIVE DRAM segment has room for the smallest queued value.

Every node task (tier moves included, see `push_task`) is replicated as ``["task", id, dst
segment, offset, size, expires_in_s]`` and ``["task_end", id, fenced]``; a standby keeps the
destinations of the leader's tasks in flight (`Drains.inflight`, `fence.apply_task`) and
`replication.take_over` quarantines them (`fence.fence_inflight`), since the old leader's node
may still be writing there.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.cluster_messages import NodeTask, TaskKind
from yuebing.store.master.leases import grant
from yuebing.store.master.placement import PlacementRequest, free_ratio_first
from yuebing.store.master.state import Obj, ObjState, Seg, SegState, Task

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
MIGRATE = TaskKind.MIGRATE
DRAINING = SegState.DRAINING


class Drains:
    """Migration bookkeeping kept on the core (not replicated: a new leader rebuilds it from the
    nodes' repeated `Drain` requests). ``queue`` is an ordered set of keys waiting for a
    migration (``min_size``: the smallest value queued, 0 when empty); ``tried`` maps a key to
    the destination segments whose migration failed; ``risk`` / ``spare`` map each draining
    segment to its keys (see the module docstring; ``dirty``: rebuild them; ``walked``: when
``refresh`` last walked each risk set). ``inflight``
    (standby only) maps the leader's task ids to (segment, offset, size, write expiry)."""

    __slots__ = ("dirty", "handed", "inflight", "min_size", "queue", "risk", "since", "spare",
                 "tried", "walked")

    def __init__(self) -> None:
        self.queue: dict[str, None] = {}
        self.min_size = 0
        self.tried: dict[str, set[int]] = {}
        self.risk: dict[int, set[str]] = {}
        self.spare: dict[int, set[str]] = {}
        self.walked: dict[int, float] = {}  # draining segment -> when `refresh` last walked it
        self.dirty = False
        self.inflight: dict[int, tuple[int, int, int, float]] = {}
        self.since: dict[int, float] = {}  # draining segment -> when it started (master clock)
        self.handed: dict[str, float] = {}  # key -> lease end of a reply naming a draining replica


def dram_replicas(core: MasterCore, o: Obj, key: str | None = None) -> list[m.Replica]:
    """The DRAM replicas a reader of ``o`` is given (`reads.get_replicas`, promotions):
    those on draining segments only when it has no other, so a hot value does not hold a drain
    up; giving one out is noted under ``key`` (see `reader_may_hold`)."""
    segs = core.segs
    reps = [(segs[s], off) for s, off in o.reps if segs[s].tier == 0]
    for sg, _ in reps:
        if sg.state == DRAINING:
            active = [r for r in reps if r[0].state != DRAINING]
            if active:
                reps = active
            elif key is not None:
                core.drains.handed[key] = o.lease
            break
    return [m.Replica(segment=sg.name, offset=off) for sg, off in reps]


def keep_lease(core: MasterCore, key: str, o: Obj) -> None:
    """`reads.get_replicas` is about to overwrite ``o``'s running lease while a drain runs
    (it calls this only then): when that lease was granted before a segment holding one of
    ``o``'s replicas began draining, its reader was given every replica, so the lease is
    noted as a hand-out (``handed``) before it is forgotten and `reader_may_hold` still
    counts that reader. O(replicas)."""
    d = core.drains
    granted = o.lease - core.cfg.lease_ttl_s
    for sid, _ in o.reps:
        since = d.since.get(sid)
        if since is not None and granted <= since:
            if o.lease > d.handed.get(key, 0.0):
                d.handed[key] = o.lease
            return


def reader_may_hold(core: MasterCore, key: str, o: Obj, sid: int, now: float) -> bool:
    """Whether a reader may still be copying ``o``'s replica on draining segment ``sid``: one
    was handed it during the drain and its lease runs, or ``o``'s lease was granted before the
    drain started (then every replica was given out). A lease granted later, with no hand-out
    noted, named only replicas elsewhere: it does not hold the draining one."""
    d = core.drains
    handed = d.handed.get(key)
    if handed is not None:
        if handed > now:
            return True
        del d.handed[key]
    if o.lease <= now:
        return False
    since = d.since.get(sid)
    return since is None or o.lease - core.cfg.lease_ttl_s <= since


def at_risk(core: MasterCore, o: Obj) -> bool:
    """True when unmounting the draining segments would leave ``o`` without a replica."""
    segs = core.segs
    return bool(o.reps) and all(segs[sid].state == DRAINING for sid, _ in o.reps)


def index(core: MasterCore) -> None:
    """(Re)build ``risk`` / ``spare`` when a segment started draining or one was dropped since
    the last build: one walk over the objects (rare; nothing else walks them all)."""
    d: Drains = core.drains
    draining = {sid for sid, s in core.segs.items() if s.state == DRAINING}
    if not d.dirty and draining == d.risk.keys():
        return
    d.dirty = False
    d.walked.clear()
    d.risk = {sid: set() for sid in draining}
    d.spare = {sid: set() for sid in draining}
    if not draining:
        return
    for key, o in core.objs.items():
        mine = [sid for sid, _ in o.reps if sid in draining]
        if mine:
            into = d.risk if len(mine) == len(o.reps) else d.spare
            for sid in mine:
                into[sid].add(key)


def recheck(core: MasterCore, key: str, o: Obj) -> None:
    """``o`` lost a replica (eviction): file it as at risk on its draining segments if it is
    now. Called by `eviction.drop_replicas`."""
    d: Drains = core.drains
    if d.risk and at_risk(core, o):
        for sid, _ in o.reps:
            if sid in d.risk:
                d.risk[sid].add(key)
                d.spare[sid].discard(key)


def file_key(core: MasterCore, key: str, o: Obj) -> None:
    """``o`` gained a replica (a tier task or a migration landed): file ``key`` under each
    draining segment it is on, as *risk* or *spare*, so the drain counts it (a segment may have
    begun draining while the task ran, after the index was built). Called by
    `segments.task_done` and `finished`; O(replicas)."""
    d: Drains = core.drains
    if not d.risk:
        return
    into, other = (d.risk, d.spare) if at_risk(core, o) else (d.spare, d.risk)
    for sid, _ in o.reps:
        if sid in into:
            into[sid].add(key)
            other[sid].discard(key)


def _on(o: Obj, sid: int) -> bool:
    return any(r[0] == sid for r in o.reps)


def refresh(core: MasterCore, sid: int) -> tuple[int, int]:
    """Queue the committed at-risk values with a replica on draining segment ``sid``; return
    how many values (pending ones included: they would be lost too) are at risk there and, once
    none is, how many there a reader still leases (-1 while some are at risk). Walks the risk
    set after an index build, while it is small, or once ``_walk_every`` passed; between walks
    its size is the count (migrations take keys out at once; a key dropped meanwhile is
    counted until the next walk, which only makes the node wait longer)."""
    index(core)
    d: Drains = core.drains
    risk, spare = d.risk.get(sid), d.spare.get(sid)
    if risk is None or spare is None:
        return 0, 0
    now = core.clock.now()
    if len(risk) > WALK_ALWAYS and now < d.walked.get(sid, 0.0) + _walk_every(len(risk)):
        return len(risk), -1
    d.walked[sid] = now
    objs, segs, n, gone = core.objs, core.segs, 0, []
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
        if (o.state == ObjState.COMMITTED and not o.moving and key not in d.queue
                and len(d.tried.get(key, ())) < MAX_ATTEMPTS):
            d.queue[key] = None
            d.min_size = min(d.min_size, o.size) if d.min_size else o.size
    risk.difference_update(gone)
    if n:
        return n, -1
    leased, gone = 0, []
    for key in spare:
        o = objs.get(key)
        if o is None or not any(r[0] == sid for r in o.reps):
            gone.append(key)
        elif reader_may_hold(core, key, o, sid, now):
            leased += 1
    spare.difference_update(gone)
    return 0, leased


WALK_ALWAYS = 20_000
"""A risk set up to this size is walked on every `Drain` (a few ms)."""


def _walk_every(n: int) -> float:
    """Seconds between walks of a risk set of ``n`` keys (~2 us each): at most ~5% of a core
    however often the node asks."""
    return max(0.5, n * 2e-6 * 20)


def in_flight(core: MasterCore) -> int:
    return sum(1 for t in core.tasks.values() if t.kind == MIGRATE)


def _room(core: MasterCore) -> int:
    """The largest free range on an ACTIVE DRAM segment (what a migration could get)."""
    return max((s.alloc.largest_free for s in core.segs.values()
                if s.tier == m.Tier.DRAM and s.state == SegState.ACTIVE and s.alloc is not None),
               default=0)


def pump(core: MasterCore) -> int:
    """Start queued migrations while fewer than ``drain_parallel`` are in flight; returns how
    many were started. Called by `segments.drain`, `MasterCore.tick` and `finished`. Returns
    at once when no ACTIVE DRAM segment has room for the smallest queued value."""
    d: Drains = core.drains
    if not d.queue:
        d.min_size = 0
        if d.tried and not any(s.state == DRAINING for s in core.segs.values()):
            d.tried.clear()
        return 0
    busy = in_flight(core)
    room = _room(core)
    align = core.cfg.alignment
    if busy >= core.cfg.drain_parallel or room < -(-d.min_size // align) * align:
        return 0
    started = 0
    smallest = 0
    for key in list(d.queue):
        if busy >= core.cfg.drain_parallel:
            smallest = 0  # not every entry seen: keep the old bound
            break
        o = core.objs.get(key)
        if o is None or not at_risk(core, o) or len(d.tried.get(key, ())) >= MAX_ATTEMPTS:
            del d.queue[key]
            continue
        fits = -(-o.size // align) * align <= room
        if o.state == ObjState.COMMITTED and not o.moving and fits and start(core, key, o):
            del d.queue[key]
            busy += 1
            started += 1
            room = _room(core)
            continue
        smallest = min(smallest, o.size) if smallest else o.size  # a tier move, or no room
    else:
        d.min_size = smallest  # every entry seen: the exact bound (0: the queue is empty)
    return started


def _destination(core: MasterCore, o: Obj, src: Seg, avoid: set[int]) -> tuple[Seg, int] | None:
    held = {sid for sid, _ in o.reps}
    cands = []
    for s in core.segs.values():
        if (s.tier == m.Tier.DRAM and s.state == SegState.ACTIVE and s.alloc is not None
                and s.id not in held and s.id not in avoid
                and s.alloc.largest_free >= s.alloc.rounded(o.size)):
            cands.append(s)
    ordered = free_ratio_first(cands, PlacementRequest(o.size), core.rng)
    ordered.sort(key=lambda s: s.node == src.node)  # stable: other nodes first
    for s in ordered:
        off = s.alloc.alloc(o.size)  # type: ignore[union-attr]
        if off is not None:
            return s, off
    return None


def push_task(core: MasterCore, key: str, o: Obj, src: tuple[int, int], dst: Seg, off: int,
              kind: int, node_client: str) -> int:
    """Record a node task copying ``o`` from ``src`` to ``dst``/``off`` (allocated by the
    caller), replicate it, and queue its `NodeTask` for ``node_client`` (only that node's
    `TaskDone` counts). Its write expiry is ``put_timeout_s`` from now. Used by `start` and
    `segments.start_task`; returns the task id."""
    tid = core.next_task
    core.next_task += 1
    window = core.cfg.put_timeout_s
    core.tasks[tid] = Task(key, src, (dst.id, off), o.size, kind, node_client,
                           core.clock.now() + window)
    o.moving = tid
    core._log(["task", tid, dst.id, off, o.size, window])
    core.outbox.append((node_client, NodeTask(
        task=tid, src_segment=core.segs[src[0]].name, src_offset=src[1], dst_segment=dst.name,
        dst_offset=off, size=o.size, kind=kind, expires_in_s=window)))
    return tid


def start(core: MasterCore, key: str, o: Obj) -> bool:
    """Allocate a destination for ``o`` (at risk, or an SSD-only value whose node has no ACTIVE
    DRAM segment: `segments.promote`) and push the task; False when no room."""
    segs = core.segs
    src = min(o.reps, key=lambda r: segs[r[0]].tier)  # a DRAM replica when there is one
    src_seg = segs[src[0]]
    found = _destination(core, o, src_seg, core.drains.tried.get(key, set()))
    if found is None:
        log.debug("no room to migrate %s off %s", key, src_seg.name)
        return False
    dst, off = found
    push_task(core, key, o, src, dst, off, MIGRATE, src_seg.client)
    core.counters["migrations_started"] += 1
    log.info("migrating %s (%d bytes) from %s %s to %s", key, o.size,
             src_seg.state.name.lower(), src_seg.name, dst.name)
    return True


def finished(core: MasterCore, t: Task, o: Obj) -> None:
    """A migration's TaskDone(ok): the destination becomes a replica (the caller removed the
    task and cleared ``o.moving``)."""
    o.reps = (t.dst, *o.reps)
    d: Drains = core.drains
    d.tried.pop(t.key, None)
    file_key(core, t.key, o)  # spare now (unless its destination began draining meanwhile):
    core.counters["migrations_done"] += 1  # eviction's drain pass may drop the old replica
    if t.waiters:  # readers of an SSD-only value asked while it moved: answer from the copy
        lid = grant(core, t.key, o, len(t.waiters))
        reply = m.ReplicaList(key=t.key, size=o.size, checksum=o.checksum,
                              replicas=dram_replicas(core, o, t.key),
                              lease_s=core.cfg.lease_ttl_s, lease_id=lid)
        core.ready.extend((w, reply) for w in t.waiters)
    pump(core)


def failed(core: MasterCore, t: Task, why: str) -> None:
    """A migration failed or its destination went away (the caller quarantined the destination
    range): queue the value again, avoiding that destination, or give it up."""
    o = core.objs.get(t.key)
    if o is None or not at_risk(core, o):
        return
    core.counters["migrations_failed"] += 1
    d: Drains = core.drains
    tried = d.tried.setdefault(t.key, set())
    tried.add(t.dst[0])
    if len(tried) >= MAX_ATTEMPTS:
        core.counters["migrations_given_up"] += 1
        log.warning("gave up migrating %s after %d failed attempts (last: %s); it is lost "
                    "when its draining segment is unmounted", t.key, len(tried), why)
        return
    log.warning("migration of %s failed (%s); trying another destination", t.key, why)
    d.queue[t.key] = None  # started again by the next pump (tick), not from here
    d.min_size = min(d.min_size, o.size) if d.min_size else o.size
