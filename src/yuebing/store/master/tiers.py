"""Moves between tiers and the end of every node task: `Tiers`.

A read of an SSD-only value promotes it (`promote`: a PROMOTE task into its node's DRAM, room
made as for a put; a MIGRATE into another node's DRAM when its own has no ACTIVE segment); the
reply waits for the copy, or, when no DRAM room is free at once, the read is served from the
SSD tier (`ssd_replicas`). `task_done` applies a node's `TaskDone` (promotion: new DRAM replica,
waiting readers answered; offload: the DRAM range freed, unless a reader leases it; migration:
`Migrations.finished`), and `fail` ends a task without a copy. Called by `Reads`, `Membership`,
`MasterCore` (`TaskDone`) and `MasterService` (a task for an unconnected node).
"""

from __future__ import annotations

import logging

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind, TaskDone, TaskKind
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.eviction import Eviction
from yuebing.store.master.fit import Room
from yuebing.store.master.leases import Leases
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import Obj, SegState
from yuebing.store.master.tasks import Tasks

log = logging.getLogger(__name__)
C = m.Code


class Tiers:
    """Tier rules over `Tasks` (it owns the tasks in flight); no state of its own."""

    __slots__ = ("cfg", "clock", "effects", "eviction", "leases", "migrations", "objects",
                 "segments", "tasks")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, objects: Objects,
                 tasks: Tasks, leases: Leases, migrations: Migrations, eviction: Eviction,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.objects = objects
        self.tasks = tasks
        self.leases = leases
        self.migrations = migrations
        self.eviction = eviction
        self.effects = effects

    def promote(self, key: str, o: Obj, waiter: object) -> tuple[C, str]:
        """Start (or join) the promotion of an SSD-only object into its owner's DRAM, or, when
        the owner has no ACTIVE DRAM segment (draining, or none), into another node's DRAM
        through a MIGRATE task (a drain migration in flight also lands in DRAM: its readers
        wait for it the same way). Room in DRAM is made as for a put (`Eviction.room_for`);
        when it is not free at once, NO_SPACE, and `Reads` serves the read from the SSD tier
        (`ssd_replicas`) instead of waiting."""
        tasks = self.tasks.tasks
        if o.moving:
            t = tasks[o.moving]
            if t.kind != TaskKind.OFFLOAD:
                if waiter is not None:
                    t.waiters.append(waiter)
                return C.OK if waiter is not None else C.PROMOTING, "promotion in flight"
        segs = self.segments.segs
        src = o.reps[0]
        dram = self.segments.of_node(segs[src[0]].node, m.Tier.DRAM)
        if dram is None:  # the owner's DRAM is draining (or it has none): copy to another node
            if not self.migrations.start(key, o):
                active = [s.id for s in segs.values() if s.tier == m.Tier.DRAM
                          and s.state == SegState.ACTIVE and s.alloc is not None]
                if (self.eviction.room_for(o.size, active) != Room.NOW
                        or not self.migrations.start(key, o)):
                    return C.NO_SPACE, f"no DRAM segment has {o.size} free bytes for {key!r}"
        elif not self.tasks.copy(key, o, src, dram, promote=True) and (
                self.eviction.room_for(o.size, [dram.id]) != Room.NOW
                or not self.tasks.copy(key, o, src, dram, promote=True)):
            return C.NO_SPACE, f"no DRAM free on {dram.name} to promote {key!r}"
        self.effects.counters["promotions"] += 1
        if waiter is not None:
            tasks[o.moving].waiters.append(waiter)
            return C.OK, ""
        return C.PROMOTING, "promotion started"

    def ssd_replicas(self, o: Obj) -> list[m.Replica]:
        """``o``'s replicas on ACTIVE SSD-tier segments (a node registers its SSD file with its
        transfer engine, so a reader can copy from it directly): a read served there when no
        DRAM room can be made at once. Draining ones are left out: their values go through
        `Migrations`."""
        segs = self.segments.segs
        return [m.Replica(segment=segs[sid].name, offset=off, tier=m.Tier.SSD)
                for sid, off in o.reps
                if segs[sid].tier == m.Tier.SSD and segs[sid].state == SegState.ACTIVE]

    def fail(self, tid: int, why: str, landed: bool) -> None:
        """End task ``tid`` without a new replica (`Tasks.end`); a migration's value is queued
        again or given up (`Migrations.failed`)."""
        t = self.tasks.end(tid, why, landed)
        if t.kind == TaskKind.MIGRATE:
            self.migrations.failed(t, why)

    def task_done(self, msg: TaskDone) -> None:
        """A node's answer to a task. Ignored unless the task is in flight here and
        ``msg.client`` is the node it was sent to (a late answer to another leader's task must
        not match ours)."""
        tasks = self.tasks.tasks
        t = tasks.get(msg.task)
        if t is None or t.client != msg.client:
            log.info("ignoring TaskDone %d from %s: no such task sent to it", msg.task,
                     msg.client)
            return
        o = self.objects.objs.get(t.key)
        if not msg.ok or o is None or o.moving != msg.task:
            landed = msg.ok or t.kind != TaskKind.MIGRATE  # a failed transfer may still land
            self.fail(msg.task, msg.message or "object changed", landed)
            return
        self.tasks.finish(msg.task)
        o.moving = 0
        segs = self.segments.segs
        effects = self.effects
        effects.events.append((EventKind.STORED, t.key, [segs[t.dst[0]].name]))
        if t.kind == TaskKind.MIGRATE:
            self.migrations.finished(t, o)
        elif t.promote:
            o.reps = (t.dst, *o.reps)
            lid = self.leases.grant(t.key, o, len(t.waiters))
            reply = m.ReplicaList(key=t.key, size=o.size, checksum=o.checksum,
                                  replicas=self.migrations.dram_replicas(o, t.key),
                                  lease_s=self.cfg.lease_ttl_s, lease_id=lid)  # draining: noted
            effects.ready.extend((w, reply) for w in t.waiters)
        elif o.lease > self.clock.now():  # read while offloading: keep both copies for now;
            o.reps = (*o.reps, t.dst)      # eviction drops the DRAM one once the lease is over
            effects.counters["offloads"] += 1
        else:  # offload: the DRAM source range is freed, the SSD copy replaces it
            s = segs.get(t.src[0])
            if s is not None and s.alloc is not None:
                s.alloc.free_range(t.src[1], o.size)
            o.reps = (*(r for r in o.reps if r != t.src), t.dst)
            effects.counters["offloads"] += 1
            if s is not None:
                effects.events.append((EventKind.REMOVED, t.key, [s.name]))
        if t.kind != TaskKind.MIGRATE:  # its destination may have begun draining meanwhile
            self.migrations.file_key(t.key, o)
        effects.entry(["reps", t.key, o.reps])
        effects.entry(["task_end", msg.task, False])
