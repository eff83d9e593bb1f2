"""Node tasks in flight: `Tasks` owns every copy the master asked a node to run (a DRAM<->SSD
tier move, or a drain migration) and the ids it gives them.

`push` records a task (destination allocated by the caller), replicates it as a ``task`` entry
and queues its `NodeTask` for the node; `copy` allocates the destination first. `end` finishes a
task without a new replica: its destination is freed, or quarantined by the write fence while
its writes may still land, and the readers waiting on it get an error. Called by `Eviction`
(offloads), `Migrations` (MIGRATE), `Tiers` (promotions, `TaskDone`) and `Membership`.
"""

from __future__ import annotations

import logging

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import NodeTask, TaskKind
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.objects import Objects
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import Obj, Seg, Task

log = logging.getLogger(__name__)
C = m.Code


class Tasks:
    """``tasks`` (id -> `Task`) and ``next_id``."""

    __slots__ = ("cfg", "clock", "effects", "fence", "next_id", "objects", "segments", "tasks")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, objects: Objects,
                 fence: WriteFence, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.objects = objects
        self.fence = fence
        self.effects = effects
        self.tasks: dict[int, Task] = {}
        self.next_id = 1

    def push(self, key: str, o: Obj, src: tuple[int, int], dst: Seg, off: int, kind: int,
             node_client: str) -> int:
        """Record a node task copying ``o`` from ``src`` to ``dst``/``off`` (allocated by the
        caller), replicate it, and queue its `NodeTask` for ``node_client`` (only that node's
        `TaskDone` counts). Its write expiry is ``put_timeout_s`` from now. Returns its id."""
        tid = self.next_id
        self.next_id += 1
        window = self.cfg.put_timeout_s
        self.tasks[tid] = Task(key, src, (dst.id, off), o.size, kind, node_client,
                               self.clock.now() + window)
        o.moving = tid
        self.effects.entry(["task", tid, dst.id, off, o.size, window])
        self.effects.outbox.append((node_client, NodeTask(
            task=tid, src_segment=self.segments.segs[src[0]].name, src_offset=src[1],
            dst_segment=dst.name, dst_offset=off, size=o.size, kind=kind, expires_in_s=window)))
        return tid

    def copy(self, key: str, o: Obj, src: tuple[int, int], dst: Seg, promote: bool) -> bool:
        """Allocate on ``dst`` and push a tier task (PROMOTE or OFFLOAD) to its node; False
        when ``dst`` is full."""
        assert dst.alloc is not None
        off = dst.alloc.alloc(o.size)
        if off is None:
            return False
        kind = TaskKind.PROMOTE if promote else TaskKind.OFFLOAD
        self.push(key, o, src, dst, off, kind, dst.client)
        return True

    def end(self, tid: int, why: str, landed: bool) -> Task:
        """End task ``tid`` without a new replica and return it. ``landed``: the node reported
        it over and none of its writes can still arrive (a local tier copy, or a migration that
        wrote everything), so the destination is freed at once; otherwise it is quarantined
        until the task's write expiry + ``write_grace_s`` + ``fence_s`` (the standby learns
        which from ``task_end``)."""
        t = self.tasks.pop(tid)
        s = self.segments.segs.get(t.dst[0])
        now = self.clock.now()
        until = t.expiry + self.cfg.write_grace_s + self.cfg.fence_s
        mounted = s is not None and s.alloc is not None
        fenced = mounted and not landed and until > now
        if s is not None and s.alloc is not None:
            if fenced:
                self.fence.task_failed(until, s, t.dst[1], t.size)
                log.info("task %d (%s) ended without a copy: %s quarantined for %.2fs", tid,
                         why, s.name, until - now)
            else:
                s.alloc.free_range(t.dst[1], t.size)
        self.effects.entry(["task_end", tid, fenced])
        o = self.objects.objs.get(t.key)
        if o is not None and o.moving == tid:
            o.moving = 0
            if not o.reps:
                self.objects.drop(t.key, o)
        for w in t.waiters:
            self.effects.ready.append(
                (w, m.Err(code=C.INTERNAL, message=f"move to DRAM failed: {why}")))
        return t

    def finish(self, tid: int) -> None:
        """Task ``tid`` landed (`Tiers.task_done` applies its copy)."""
        del self.tasks[tid]

    def clear(self) -> None:
        self.tasks.clear()

    def count(self, kind: int) -> int:
        """Tasks of ``kind`` in flight."""
        return sum(1 for t in self.tasks.values() if t.kind == kind)

    def offloading(self) -> int:
        """Bytes of OFFLOAD tasks in flight (their DRAM ranges free when they end)."""
        return sum(t.size for t in self.tasks.values() if t.kind == TaskKind.OFFLOAD)

    def restart(self, first_id: int) -> None:
        """A new leader: forget the old leader's tasks (their destinations are fenced by
        `WriteFence.fence_inflight`); ids continue from ``first_id`` unless already past it."""
        self.tasks.clear()
        self.next_id = max(self.next_id, first_id)
