"""Drain migrations of the master core: a draining segment loses no committed value while the
rest of the cluster has room.

A value is *at risk* when every replica it has lies on a DRAINING segment (its sole copy is
there, or its other copies are on segments draining too): unmounting would lose it. ``refresh``
(called by each `Drain` request, which the node repeats while it waits) counts the at-risk
values of a segment and queues the committed ones; ``pump`` (after each `Drain`, on every tick
and when a migration ends) starts up to ``drain_parallel`` migrations. A migration allocates a
range on an ACTIVE DRAM segment chosen like a put's placement (free ratio, not a segment the
value is already on, another node first) and pushes a MIGRATE `NodeTask` to the node owning the
source replica (a DRAM replica preferred; an SSD-only value is read from the owner's file); the
node writes the bytes with its transfer engine and answers `TaskDone`. On success the new
replica is added (first, so new readers use it; a STORED event; a ``reps`` replication entry
so a standby taking over keeps it) while the draining replica stays for readers holding leases
until eviction's drain pass or the unmount drops it. On failure the destination range is freed
and the value is queued again, avoiding the destinations that failed, at most
``MAX_ATTEMPTS`` times; then it is given up with a log line (it stays in the `Drain` count). A
value without room anywhere stays queued (room may appear) and counted. Leases, pins and soft
pins live on the object, so they move with it. Only DRAM segments are destinations: an SSD tier
is a node-local file that no transfer engine can write remotely; the destination node's
watermark eviction may offload the copy to its own SSD later.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.master.placement import PlacementRequest, free_ratio_first
from yuebing.store.master.state import Obj, ObjState, Seg, SegState, Task

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
MAX_ATTEMPTS = 3
MIGRATE = m.TaskKind.MIGRATE


class Drains:
    """Migration bookkeeping kept on the core (not replicated: a new leader rebuilds it from the
    nodes' repeated `Drain` requests). ``queue`` is an ordered set of keys waiting for a
    migration; ``tried`` maps a key to the destination segments whose migration failed."""

    __slots__ = ("queue", "tried")

    def __init__(self) -> None:
        self.queue: dict[str, None] = {}
        self.tried: dict[str, set[int]] = {}


def at_risk(core: MasterCore, o: Obj) -> bool:
    """True when unmounting the draining segments would leave ``o`` without a replica."""
    segs = core.segs
    return bool(o.reps) and all(segs[sid].state == SegState.DRAINING for sid, _ in o.reps)


def refresh(core: MasterCore, sid: int) -> int:
    """Queue the committed at-risk values with a replica on segment ``sid``; return how many
    values (pending ones included: they would be lost too) are at risk there."""
    d: Drains = core.drains
    n = 0
    for key, o in core.objs.items():
        if not any(r[0] == sid for r in o.reps) or not at_risk(core, o):
            continue
        n += 1
        if (o.state == ObjState.COMMITTED and not o.moving and key not in d.queue
                and len(d.tried.get(key, ())) < MAX_ATTEMPTS):
            d.queue[key] = None
    return n


def in_flight(core: MasterCore) -> int:
    return sum(1 for t in core.tasks.values() if t.kind == MIGRATE)


def pump(core: MasterCore) -> int:
    """Start queued migrations while fewer than ``drain_parallel`` are in flight; returns how
    many were started. Called by `segments.drain`, `MasterCore.tick` and `finished`."""
    d: Drains = core.drains
    if not d.queue:
        if d.tried and not any(s.state == SegState.DRAINING for s in core.segs.values()):
            d.tried.clear()
        return 0
    busy = in_flight(core)
    started = 0
    for key in list(d.queue):
        if busy >= core.cfg.drain_parallel:
            break
        o = core.objs.get(key)
        if o is None or not at_risk(core, o) or len(d.tried.get(key, ())) >= MAX_ATTEMPTS:
            del d.queue[key]
            continue
        if o.state != ObjState.COMMITTED or o.moving:
            continue  # a tier move in flight: try again once it ended
        if start(core, key, o):
            del d.queue[key]
            busy += 1
            started += 1
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


def start(core: MasterCore, key: str, o: Obj) -> bool:
    """Allocate a destination for at-risk ``o`` and push the task; False when no room."""
    segs = core.segs
    src = min(o.reps, key=lambda r: segs[r[0]].tier)  # a DRAM replica when there is one
    src_seg = segs[src[0]]
    found = _destination(core, o, src_seg, core.drains.tried.get(key, set()))
    if found is None:
        log.debug("no room to migrate %s off %s", key, src_seg.name)
        return False
    dst, off = found
    tid = core.next_task
    core.next_task += 1
    core.tasks[tid] = Task(key, src, (dst.id, off), o.size, MIGRATE)
    o.moving = tid
    core.outbox.append((src_seg.client, m.NodeTask(
        task=tid, src_segment=src_seg.name, src_offset=src[1], dst_segment=dst.name,
        dst_offset=off, size=o.size, kind=MIGRATE)))
    core.counters["migrations_started"] += 1
    log.info("migrating %s (%d bytes) from draining %s to %s", key, o.size, src_seg.name,
             dst.name)
    return True


def finished(core: MasterCore, t: Task, o: Obj) -> None:
    """A migration's TaskDone(ok): the destination becomes a replica (the caller removed the
    task and cleared ``o.moving``)."""
    o.reps = (t.dst, *o.reps)
    core.drains.tried.pop(t.key, None)
    core.counters["migrations_done"] += 1
    if t.waiters:  # readers of an SSD-only value asked while it moved: answer from the copy
        o.lease = core.clock.now() + core.cfg.lease_ttl_s
        reply = m.ReplicaList(key=t.key, size=o.size, checksum=o.checksum,
                              replicas=core._dram_reps(o))
        core.ready.extend((w, reply) for w in t.waiters)
    pump(core)


def failed(core: MasterCore, t: Task, why: str) -> None:
    """A migration failed or its destination went away (the caller freed the destination
    range): queue the value again, avoiding that destination, or give it up."""
    o = core.objs.get(t.key)
    if o is None or not at_risk(core, o):
        return
    core.counters["migrations_failed"] += 1
    tried = core.drains.tried.setdefault(t.key, set())
    tried.add(t.dst[0])
    if len(tried) >= MAX_ATTEMPTS:
        core.counters["migrations_given_up"] += 1
        log.warning("gave up migrating %s after %d failed attempts (last: %s); it is lost "
                    "when its draining segment is unmounted", t.key, len(tried), why)
        return
    log.warning("migration of %s failed (%s); trying another destination", t.key, why)
    core.drains.queue[t.key] = None  # started again by the next pump (tick), not from here
