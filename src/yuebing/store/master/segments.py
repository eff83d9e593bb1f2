"""Segments, sessions and tier tasks of the master core.

A node mounts its DRAM segment (and optionally an SSD segment) under its session; the session
lives while heartbeats arrive. When it expires, its segments are unmounted (objects lose those
replicas; an object with none left is removed) and its pending puts are revoked. Zombie puts
(never ended) are reclaimed after ``put_timeout_s``. Tier moves are node tasks: the master
allocates the destination range, pushes a `NodeTask` to the segments' owner and, on `TaskDone`,
swaps the replica (offload: DRAM -> SSD frees the DRAM range; promotion: SSD -> DRAM adds a DRAM
replica and answers the readers that waited; an SSD-only value whose node has no ACTIVE DRAM
segment, e.g. a draining node, is copied into another node's DRAM by a MIGRATE task instead).
Only the node a task was sent to can end it. A task that failed with writes possibly still in
flight (a migration, or any task whose segment went away) has its destination quarantined
(`fence`) until its write expiry + ``write_grace_s`` + ``fence_s`` instead of freed. ``drain``
marks a segment DRAINING (no new placements) and has `migration` copy the values it would lose
to other segments; the `DrainStatus` reply counts the values still at risk and then the values
a reader still leases there, which the node waits on before it unmounts.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.cluster_messages import (
    DRAIN_SAMPLE,
    Drain,
    DrainStatus,
    EventKind,
    Mount,
    TaskDone,
    TaskKind,
    Unmount,
)
from yuebing.store.master import fence, fit, incarnations, leases, migration, reserve
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.state import Obj, ObjState, Seg, SegState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
C = m.Code


def mount(core: MasterCore, msg: Mount) -> m.Message:
    if not msg.segment or msg.size <= 0 or msg.tier not in (0, 1):
        return m.Err(code=C.BAD_REQUEST, message="mount needs a segment name, size > 0, tier 0|1")
    refused = incarnations.on_mount(core, msg)  # a restarted node's old segments go first
    if refused is not None:
        return refused
    sid = core.seg_by_name.get(msg.segment)
    if sid is not None:
        s = core.segs[sid]
        if s.client == msg.client and s.size == msg.size and s.tier == msg.tier:
            return m.Ok()  # idempotent re-mount
        return m.Err(code=C.EXISTS, message=f"segment {msg.segment!r} is mounted by {s.client!r}")
    sid = core.next_seg
    add_segment(core, sid, msg.segment, msg.size, msg.tier, msg.node or msg.client, msg.client,
                OffsetAllocator(msg.size, core.cfg.alignment), msg.incarnation)
    core._log(["mount", sid, msg.segment, msg.size, msg.tier, msg.node or msg.client, msg.client,
               msg.incarnation])
    log.info("mounted %s (%d bytes, tier %d) for %s", msg.segment, msg.size, msg.tier, msg.client)
    return m.Ok()


def add_segment(core: MasterCore, sid: int, name: str, size: int, tier: int, node: str,
                client: str, alloc: OffsetAllocator | None, incarnation: str = "") -> Seg:
    s = Seg(sid, name, size, tier, node, client, alloc, incarnation)
    core.segs[sid] = s
    core.seg_by_name[name] = sid
    core.quarantine.adopt(name, sid, size, core.cfg.alignment, alloc)  # fence of a re-mount
    core.next_seg = max(core.next_seg, sid + 1)
    sess = core.sessions.get(client)
    if sess is None:
        sess = core.touch_session(client, None)
    sess.segs.add(sid)
    if incarnation:  # the last mounted (also replayed on a standby) is the current process
        sess.incarnation = incarnation
    return s


def _owned(core: MasterCore, msg: Unmount | Drain) -> Seg | m.Err:
    sid = core.seg_by_name.get(msg.segment)
    if sid is None:
        return m.Err(code=C.UNKNOWN_SEGMENT, message=f"no segment {msg.segment!r} is mounted")
    s = core.segs[sid]
    if s.client != msg.client:
        return m.Err(code=C.BAD_REQUEST, message=f"segment {msg.segment!r} belongs to {s.client!r}")
    if not incarnations.owns(s, msg):
        return m.Err(code=C.UNKNOWN_SEGMENT, message=(
            f"segment {msg.segment!r} is mounted by another process of {msg.client!r}"))
    return s


def unmount(core: MasterCore, msg: Unmount) -> m.Message:
    s = _owned(core, msg)
    if isinstance(s, m.Err):
        return s
    drop_segment(core, s.id)
    return m.Ok()


def drain(core: MasterCore, msg: Drain) -> m.Message:
    s = _owned(core, msg)
    if isinstance(s, m.Err):
        return s
    if s.state != SegState.DRAINING:
        s.state = SegState.DRAINING
        core.drains.since[s.id] = core.clock.now()
        core._log(["drain", s.id])
        log.warning("segment %s is draining", s.name)
        reserve.drop_on_segment(core, s.id, f"segment {s.name} is draining")
    n, leased = migration.refresh(core, s.id)
    migration.pump(core)
    sample = list(itertools.islice(core.drains.risk.get(s.id, ()), DRAIN_SAMPLE)) if n else []
    return DrainStatus(at_risk=n, leased=leased, keys=sample)


def drop_segment(core: MasterCore, sid: int) -> None:
    """Unmount: every object loses its replica there; objects left without one are removed
    (reservations with a replica there are dropped first). Tasks writing there fail first,
    while the segment is still mounted, so their destinations are quarantined until the task's
    write expiry + ``write_grace_s`` + ``fence_s`` (a node may still be sending). Those ranges
    and the pending puts' ranges there stay quarantined under the segment's name until their
    fence (`fence.segment_dropped`), and a re-mount under that name gets them back fenced."""
    reserve.drop_on_segment(core, sid, "segment unmounted")
    s = core.segs[sid]
    why = f"segment {s.name} was unmounted"
    for tid in [tid for tid, t in core.tasks.items() if t.dst[0] == sid]:
        _fail_task(core, tid, why, landed=False)  # still mounted: its destination is fenced
    del core.segs[sid]
    del core.seg_by_name[s.name]
    core.drains.since.pop(sid, None)
    if not core.drains.since:  # no drain left: forget the hand-outs noted for them
        core.drains.handed.clear()
    sess = core.sessions.get(s.client)
    if sess is not None:
        sess.segs.discard(sid)
    core._log(["unmount", sid])
    dead: list[str] = []
    fenced: list[tuple[str, int, int]] = []
    for key, o in core.objs.items():
        if any(r[0] == sid for r in o.reps):
            if o.state == ObjState.PENDING:
                fenced.extend((key, off, o.size) for r_sid, off in o.reps if r_sid == sid)
            o.reps = tuple(r for r in o.reps if r[0] != sid)
            if o.state == ObjState.COMMITTED:
                core.events.append((EventKind.REMOVED, key, [s.name]))
                if not o.reps and o.moving == 0:
                    dead.append(key)  # a pending one stays until put_end/revoke/timeout
    fence.segment_dropped(core, s, fenced)
    for key in dead:
        core._drop(key, core.objs[key], event=False)
    for tid in [tid for tid, t in core.tasks.items() if t.src[0] == sid]:
        _fail_task(core, tid, why, landed=False)  # its destination elsewhere is fenced there
    core.drains.dirty = True  # values with a replica here may be at risk now
    log.warning("segment %s dropped; %d objects lost their last replica", s.name, len(dead))


def expire_sessions(core: MasterCore) -> None:
    now = core.clock.now()
    for client, sess in list(core.sessions.items()):
        if sess.deadline < now:
            log.warning("session %s expired; dropping its segments and pending puts", client)
            core.counters["dead_sessions"] += 1
            for sid in list(sess.segs):
                drop_segment(core, sid)
            for key in [k for k in core.pending if core.objs[k].owner == client]:
                core._drop(key, core.objs[key], event=False)
            del core.sessions[client]


def reclaim_zombies(core: MasterCore) -> None:
    now = core.clock.now()
    for key in [k for k, d in core.pending.items() if d < now]:
        if key in core.reservations.by_key:  # unused until its write expiry: expected
            core.counters["reservations_expired"] += 1
            log.info("reservation %s expired unused", key)
        else:
            core.counters["zombies"] += 1
            log.warning("reclaiming zombie put %s", key)
        core._drop(key, core.objs[key], event=False)


# ---------------------------------------------------------------------- tier tasks
def ssd_of(core: MasterCore, node: str, tier: int) -> Seg | None:
    for s in core.segs.values():
        if s.node == node and s.tier == tier and s.state == SegState.ACTIVE and s.alloc:
            return s
    return None


def start_task(core: MasterCore, key: str, o: Obj, src: tuple[int, int], dst: Seg,
               promote: bool) -> bool:
    """Allocate on ``dst`` and push a copy task to its node; False when ``dst`` is full."""
    assert dst.alloc is not None
    off = dst.alloc.alloc(o.size)
    if off is None:
        return False
    kind = TaskKind.PROMOTE if promote else TaskKind.OFFLOAD
    migration.push_task(core, key, o, src, dst, off, kind, dst.client)
    return True


def promote(core: MasterCore, key: str, o: Obj, waiter: object) -> tuple[C, str]:
    """Start (or join) the promotion of an SSD-only object into its owner's DRAM, or, when the
    owner has no ACTIVE DRAM segment (draining, or none), into another node's DRAM through a
    MIGRATE task (a drain migration in flight also lands in DRAM: its readers wait for it the
    same way). Room in DRAM is made as for a put (`eviction.room_for`: one contiguous range,
    DRAM victims offloaded to the SSD tier); when it is not free at once, NO_SPACE, and the
    caller (``reads.get_replicas``) serves the read from the SSD tier (`ssd_replicas`)
    instead of waiting."""
    if o.moving:
        t = core.tasks[o.moving]
        if t.kind != TaskKind.OFFLOAD:
            if waiter is not None:
                t.waiters.append(waiter)
            return C.OK if waiter is not None else C.PROMOTING, "promotion in flight"
    from yuebing.store.master import eviction

    src = o.reps[0]
    dram = ssd_of(core, core.segs[src[0]].node, m.Tier.DRAM)
    if dram is None:  # the owner's DRAM is draining (or it has none): copy to another node
        if not migration.start(core, key, o):
            active = [s.id for s in core.segs.values() if s.tier == m.Tier.DRAM
                      and s.state == SegState.ACTIVE and s.alloc is not None]
            if (eviction.room_for(core, o.size, active) != fit.Room.NOW
                    or not migration.start(core, key, o)):
                return C.NO_SPACE, f"no DRAM segment has {o.size} free bytes for {key!r}"
    elif not start_task(core, key, o, src, dram, promote=True) and (
            eviction.room_for(core, o.size, [dram.id]) != fit.Room.NOW
            or not start_task(core, key, o, src, dram, promote=True)):
        return C.NO_SPACE, f"no DRAM free on {dram.name} to promote {key!r}"
    core.counters["promotions"] += 1
    if waiter is not None:
        core.tasks[o.moving].waiters.append(waiter)
        return C.OK, ""
    return C.PROMOTING, "promotion started"


def ssd_replicas(core: MasterCore, o: Obj) -> list[m.Replica]:
    """``o``'s replicas on ACTIVE SSD-tier segments (a node registers its SSD file with its
    transfer engine, so a reader can copy from it directly): a read served there when no DRAM
    room can be made at once (``reads.get_replicas``). Draining ones are left out: their
    values go through `migration`."""
    segs = core.segs
    return [m.Replica(segment=segs[sid].name, offset=off, tier=m.Tier.SSD) for sid, off in o.reps
            if segs[sid].tier == m.Tier.SSD and segs[sid].state == SegState.ACTIVE]


def _fail_task(core: MasterCore, tid: int, why: str, landed: bool) -> None:
    """End task ``tid`` without a new replica. ``landed``: the node reported it over and none
    of its writes can still arrive (a local tier copy, or a migration that wrote everything),
    so the destination is freed at once; otherwise it is quarantined until the task's write
    expiry + ``write_grace_s`` + ``fence_s`` (the standby learns which from ``task_end``)."""
    t = core.tasks.pop(tid)
    s = core.segs.get(t.dst[0])
    now = core.clock.now()
    until = t.expiry + core.cfg.write_grace_s + core.cfg.fence_s
    mounted = s is not None and s.alloc is not None
    fenced = mounted and not landed and until > now
    if s is not None and s.alloc is not None:
        if fenced:
            core.quarantine.add(until, s.id, t.dst[1], t.size)
            core.counters["quarantined"] += 1
            log.info("task %d (%s) ended without a copy: %s quarantined for %.2fs", tid, why,
                     s.name, until - now)
        else:
            s.alloc.free_range(t.dst[1], t.size)
    core._log(["task_end", tid, fenced])
    o = core.objs.get(t.key)
    if o is not None and o.moving == tid:
        o.moving = 0
        if not o.reps:
            core._drop(t.key, o)
    for w in t.waiters:
        core.ready.append((w, m.Err(code=C.INTERNAL, message=f"move to DRAM failed: {why}")))
    if t.kind == TaskKind.MIGRATE:
        migration.failed(core, t, why)


def task_done(core: MasterCore, msg: TaskDone) -> None:
    """A node's answer to a task. Ignored unless the task is in flight here and ``msg.client``
    is the node it was sent to (a late answer to another leader's task must not match ours)."""
    t = core.tasks.get(msg.task)
    if t is None or t.client != msg.client:
        log.info("ignoring TaskDone %d from %s: no such task sent to it", msg.task, msg.client)
        return
    o = core.objs.get(t.key)
    if not msg.ok or o is None or o.moving != msg.task:
        landed = msg.ok or t.kind != TaskKind.MIGRATE  # a failed transfer may still land
        _fail_task(core, msg.task, msg.message or "object changed", landed)
        return
    del core.tasks[msg.task]
    o.moving = 0
    stored = EventKind.STORED
    core.events.append((stored, t.key, [core.segs[t.dst[0]].name]))
    if t.kind == TaskKind.MIGRATE:
        migration.finished(core, t, o)
    elif t.promote:
        o.reps = (t.dst, *o.reps)
        lid = leases.grant(core, t.key, o, len(t.waiters))
        reply = m.ReplicaList(key=t.key, size=o.size, checksum=o.checksum,
                              replicas=migration.dram_replicas(core, o, t.key),
                              lease_s=core.cfg.lease_ttl_s, lease_id=lid)  # draining: noted
        core.ready.extend((w, reply) for w in t.waiters)
    elif o.lease > core.clock.now():  # read while offloading: keep both copies for now;
        o.reps = (*o.reps, t.dst)      # eviction drops the DRAM one once the lease is over
        core.counters["offloads"] += 1
    else:  # offload: the DRAM source range is freed, the SSD copy replaces it
        s = core.segs.get(t.src[0])
        if s is not None and s.alloc is not None:
            s.alloc.free_range(t.src[1], o.size)
        o.reps = (*(r for r in o.reps if r != t.src), t.dst)
        core.counters["offloads"] += 1
        if s is not None:
            core.events.append((EventKind.REMOVED, t.key, [s.name]))
    if t.kind != TaskKind.MIGRATE:  # its destination may have begun draining meanwhile
        migration.file_key(core, t.key, o)
    core._log(["reps", t.key, o.reps])
    core._log(["task_end", msg.task, False])


def usage(core: MasterCore) -> dict[str, float]:
    n_resv = len(core.reservations)  # counted apart: reservations are not values
    out: dict[str, float] = {"objects": len(core.objs) - n_resv,
                             "pending": len(core.pending) - n_resv, "reservations": n_resv,
                             "segments": len(core.segs), "sessions": len(core.sessions),
                             "tasks": len(core.tasks)}
    for tier, name in ((0, "dram"), (1, "ssd")):
        allocs = [s.alloc for s in core.segs.values() if s.tier == tier and s.alloc is not None]
        out[f"{name}_capacity"] = float(sum(a.capacity for a in allocs))
        out[f"{name}_used"] = float(sum(a.used for a in allocs))
    out.update({k: float(v) for k, v in core.counters.items()})
    return out
