"""Node tasks racing the segments they write: a task's destination segment unmounted (and
mounted again under its name) or beginning to drain while the task runs, and a node that reads a
task's push late because its loop was busy (master core on a virtual clock; a socketless node)."""

from __future__ import annotations

import time
from collections import deque

import pytest
from drain_factories import KiB, done, drain, holders, make, put, tasks, used

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount, NodeTask, TaskDone, TaskKind, Unmount
from yuebing.store.config import ClientConfig
from yuebing.store.master import replication
from yuebing.store.master.core import MasterCore
from yuebing.store.node.service import StorageNode


def test_a_task_destination_on_an_unmounted_segment_stays_fenced_for_its_remount() -> None:
    core = make(segs=2)
    hub = replication.ReplicationHub(core.replication, 1.0)
    standby = MasterCore(core.cfg, VirtualClock(9000.0))
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    put(core, "v", "n0/dram")
    drain(core, "n0/dram")
    (_, t), = tasks(core)
    assert (t.dst_segment, t.dst_offset, t.size) == ("n1/dram", 0, 4 * KiB)
    assert core.handle(Unmount(client="n1", segment="n1/dram")) == m.Ok()  # n0 still writes
    (row,) = core.fence.quarantine.dump(core.clock.now())
    assert row[2:] == [0, 4 * KiB, "n1/dram"]  # kept by name until the task's fence
    for _, msg in hub.publish():
        standby.replication.apply_entries(msg.entries)
    assert [r[2:] for r in standby.fence.quarantine.dump(standby.clock.now())] == [
        [0, 4 * KiB, "n1/dram"]]
    assert core.handle(Mount(client="n1", segment="n1/dram", size=64 * KiB,
                               node="n1")) == m.Ok()
    assert used(core, "n1/dram") == 4 * KiB  # the re-mount gets the old task's range fenced
    core.tick()
    (_, again), = tasks(core)  # the migration is retried, not over the old task's range
    assert again.dst_segment == "n1/dram" and again.dst_offset >= 4 * KiB
    cfg = core.cfg
    fence = cfg.put_timeout_s + cfg.write_grace_s + cfg.fence_s
    end = core.clock.now() + fence + 0.1
    while core.clock.now() < end:  # the nodes keep their sessions while the fence runs out
        core.clock.advance_to(min(end, core.clock.now() + cfg.client_ttl_s / 2))  # type: ignore[attr-defined]
        for n in ("n0", "n1", "c"):
            core.handle(m.Heartbeat(client=n))
        core.tick()
    assert len(core.fence.quarantine) == 0 and used(core, "n1/dram") == 4 * KiB  # the retry's range


def test_a_migration_landing_on_a_segment_that_began_draining_is_still_at_risk() -> None:
    core = make(segs=3)
    put(core, "v", "n0/dram")
    assert drain(core, "n0/dram") == 1
    (owner, t), = tasks(core)
    assert t.dst_segment == "n1/dram"
    assert drain(core, "n1/dram") == 0  # n1 begins draining while the copy runs
    done(core, owner, t)
    assert holders(core, "v") == ["n1/dram", "n0/dram"]  # both draining: still at risk
    assert drain(core, "n0/dram") == 1
    (owner, t2), = tasks(core)
    assert t2.dst_segment == "n2/dram"
    done(core, owner, t2)
    assert drain(core, "n0/dram") == 0 and drain(core, "n1/dram") == 0


class PushingMaster:
    """A master connection without a socket: ``queued`` pushes are handed over by the next
    read (`poll_pushes`, or a `call` before its reply, as on one TCP stream); calls are kept."""

    def __init__(self, node: StorageNode) -> None:
        self.node = node
        self.queued: list[NodeTask] = []
        self.calls: list[m.Message] = []

    def _deliver(self) -> None:
        while self.queued:
            self.node._on_push(self.queued.pop(0))

    def poll_pushes(self, timeout_s: float) -> None:
        self._deliver()

    def call(self, msg: m.Message) -> m.Message:
        self._deliver()
        self.calls.append(msg)
        return m.Ok()


def _task(tid: int, kind: int, expires_in_s: float) -> NodeTask:
    return NodeTask(task=tid, src_segment="n0/ssd", src_offset=0, dst_segment="n1/dram",
                      dst_offset=0, size=KiB, kind=kind, expires_in_s=expires_in_s)


@pytest.mark.parametrize("busy", ["copy", "migration_start"])
def test_a_push_read_after_a_long_copy_gets_no_extra_write_time(busy: str) -> None:
    """The master pushes a MIGRATE (0.2 s to write) while the node's loop is busy for 0.4 s in
    a synchronous copy (read by the `TaskDone` call after it) or in a migration's SSD read (read
    by the next poll): the node must not start it, its write time is over."""
    node = StorageNode.__new__(StorageNode)
    node.client_id = "n0"
    node.ccfg = ClientConfig()
    node.tasks = deque()
    node._moving = {}
    node._heard = time.monotonic()
    node.tasks_done = 0
    conn = PushingMaster(node)
    node.conn = conn  # type: ignore[assignment]
    late = _task(2, TaskKind.MIGRATE, 0.2)
    started: list[int] = []

    def slow(t: NodeTask, *_: object) -> None:
        if t.task == 1:
            time.sleep(0.4)  # a slow copy keeps the node's loop busy
            conn.queued.append(late)  # pushed while the loop was busy
        else:
            started.append(t.task)

    node.copy = slow  # type: ignore[method-assign]
    node._start_migration = slow  # type: ignore[method-assign]
    kind = TaskKind.OFFLOAD if busy == "copy" else TaskKind.MIGRATE
    conn.queued.append(_task(1, kind, 30.0))
    next_hb = time.monotonic() + 60.0
    for _ in range(2):
        node._step(next_hb, wait_s=0.0)
    assert started == []
    answers = [(c.task, c.ok) for c in conn.calls if isinstance(c, TaskDone)]
    assert (2, False) in answers
    (why,) = [c.message for c in conn.calls if isinstance(c, TaskDone) and c.task == 2]
    assert "write expiry" in why
