"""Segment membership: `Membership` answers `Mount`, `Unmount` and `Drain`, and drops what a
dead session leaves.

A node mounts its DRAM segment (and optionally an SSD one) under its session; a mount from a
restarted process retires its predecessor's segments (`Sessions.on_mount`). `drop_segment`
(unmount, session expiry, retirement) fails the tasks writing there, takes the replicas there
from every object (removing values left with none), fences its pending puts' ranges under the
segment's name and drops its reservations. `drain` marks a segment DRAINING and reports what
`Migrations` still has to copy. Called by `MasterCore` (handlers, tick) and `Replication`.
"""

from __future__ import annotations

import itertools
import logging

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import DRAIN_SAMPLE, Drain, DrainStatus, Mount, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.reserve import Reserve
from yuebing.store.master.segments import Segments
from yuebing.store.master.sessions import Sessions, owns
from yuebing.store.master.state import Seg, SegState
from yuebing.store.master.tasks import Tasks
from yuebing.store.master.tiers import Tiers

log = logging.getLogger(__name__)
C = m.Code


class Membership:
    """Mount / unmount / drain rules over `Segments` and `Sessions`; no state of its own."""

    __slots__ = ("cfg", "clock", "effects", "fence", "migrations", "objects", "reserve",
                 "segments", "sessions", "tasks", "tiers")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, sessions: Sessions,
                 objects: Objects, fence: WriteFence, tasks: Tasks, migrations: Migrations,
                 tiers: Tiers, reserve: Reserve, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.sessions = sessions
        self.objects = objects
        self.fence = fence
        self.tasks = tasks
        self.migrations = migrations
        self.tiers = tiers
        self.reserve = reserve
        self.effects = effects

    def mount(self, msg: Mount) -> m.Message:
        if not msg.segment or msg.size <= 0 or msg.tier not in (0, 1):
            return m.Err(code=C.BAD_REQUEST,
                         message="mount needs a segment name, size > 0, tier 0|1")
        old = self.sessions.on_mount(msg)
        if isinstance(old, m.Err):
            return old
        for s in old:  # a restarted node's old segments go first
            self.drop_segment(s.id)
        segs = self.segments
        sid = segs.by_name.get(msg.segment)
        if sid is not None:
            s = segs.segs[sid]
            if s.client == msg.client and s.size == msg.size and s.tier == msg.tier:
                return m.Ok()  # idempotent re-mount
            return m.Err(code=C.EXISTS,
                         message=f"segment {msg.segment!r} is mounted by {s.client!r}")
        sid = segs.next_id
        self.add_segment(sid, msg.segment, msg.size, msg.tier, msg.node or msg.client,
                         msg.client, OffsetAllocator(msg.size, self.cfg.alignment),
                         msg.incarnation)
        self.effects.entry(["mount", sid, msg.segment, msg.size, msg.tier,
                            msg.node or msg.client, msg.client, msg.incarnation])
        log.info("mounted %s (%d bytes, tier %d) for %s", msg.segment, msg.size, msg.tier,
                 msg.client)
        return m.Ok()

    def add_segment(self, sid: int, name: str, size: int, tier: int, node: str, client: str,
                    alloc: OffsetAllocator | None, incarnation: str = "") -> Seg:
        """Mount (leader) or replay the mount of (standby) a segment: its fence comes back
        with it (`WriteFence.segment_mounted`), and its session lists it."""
        s = self.segments.add(sid, name, size, tier, node, client, alloc, incarnation)
        self.fence.segment_mounted(name, sid, size, alloc)
        self.sessions.add_segment(client, sid, incarnation)
        return s

    def _owned(self, msg: Unmount | Drain) -> Seg | m.Err:
        sid = self.segments.by_name.get(msg.segment)
        if sid is None:
            return m.Err(code=C.UNKNOWN_SEGMENT, message=f"no segment {msg.segment!r} is mounted")
        s = self.segments.segs[sid]
        if s.client != msg.client:
            return m.Err(code=C.BAD_REQUEST,
                         message=f"segment {msg.segment!r} belongs to {s.client!r}")
        if not owns(s, msg):
            return m.Err(code=C.UNKNOWN_SEGMENT, message=(
                f"segment {msg.segment!r} is mounted by another process of {msg.client!r}"))
        return s

    def unmount(self, msg: Unmount) -> m.Message:
        s = self._owned(msg)
        if isinstance(s, m.Err):
            return s
        self.drop_segment(s.id)
        return m.Ok()

    def drain(self, msg: Drain) -> m.Message:
        s = self._owned(msg)
        if isinstance(s, m.Err):
            return s
        d = self.migrations
        if s.state != SegState.DRAINING:
            s.state = SegState.DRAINING
            d.begin(s.id, self.clock.now())
            self.effects.entry(["drain", s.id])
            log.warning("segment %s is draining", s.name)
            self.reserve.drop_on_segment(s.id, f"segment {s.name} is draining")
        n, leased = d.refresh(s.id)
        d.pump()
        sample = list(itertools.islice(d.risk.get(s.id, ()), DRAIN_SAMPLE)) if n else []
        return DrainStatus(at_risk=n, leased=leased, keys=sample)

    def drop_segment(self, sid: int) -> None:
        """Unmount: every object loses its replica there; objects left without one are removed
        (reservations with a replica there are dropped first). Tasks writing there fail first,
        while the segment is still mounted, so their destinations are quarantined until the
        task's write expiry + ``write_grace_s`` + ``fence_s`` (a node may still be sending).
        Those ranges and the pending puts' ranges there stay quarantined under the segment's
        name until their fence, and a re-mount under that name gets them back fenced."""
        self.reserve.drop_on_segment(sid, "segment unmounted")
        segs = self.segments
        s = segs.segs[sid]
        why = f"segment {s.name} was unmounted"
        tasks = self.tasks.tasks
        for tid in [tid for tid, t in tasks.items() if t.dst[0] == sid]:
            self.tiers.fail(tid, why, landed=False)  # still mounted: its destination is fenced
        segs.remove(sid)
        self.migrations.segment_dropped(sid)
        self.sessions.discard_segment(s.client, sid)
        self.effects.entry(["unmount", sid])
        dead, fenced = self.objects.segment_lost(sid, s.name)
        self.fence.segment_dropped(s, fenced)
        objs = self.objects.objs
        for key in dead:
            self.objects.drop(key, objs[key], event=False)
        for tid in [tid for tid, t in tasks.items() if t.src[0] == sid]:
            self.tiers.fail(tid, why, landed=False)  # its destination elsewhere is fenced there
        log.warning("segment %s dropped; %d objects lost their last replica", s.name, len(dead))

    def expire_sessions(self) -> None:
        """Tick: drop the sessions whose deadline passed, with their segments and pending
        puts."""
        objects = self.objects
        for client, sess in self.sessions.expired():
            log.warning("session %s expired; dropping its segments and pending puts", client)
            self.effects.counters["dead_sessions"] += 1
            for sid in list(sess.segs):
                self.drop_segment(sid)
            objs = objects.objs
            for key in [k for k in objects.pending if objs[k].owner == client]:
                objects.drop(key, objs[key], event=False)
            self.sessions.forget(client)
