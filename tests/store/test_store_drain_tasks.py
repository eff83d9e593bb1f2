"""Node tasks across failover and their write fence, lease-aware drain status, the drain's cost
(no walk over every object per request or tick) and reads of SSD-only values on a draining node
(master core, virtual clock, no sockets)."""

from __future__ import annotations

import time

from drain_factories import MIGRATE, KiB, done, drain, holders, make, put, tasks, used

from yuebing.core.clock import VirtualClock
from yuebing.core.errors import StoreError
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, DrainStatus, Mount
from yuebing.store.config import ClientConfig
from yuebing.store.master import replication
from yuebing.store.master.core import MasterCore
from yuebing.store.node.service import StorageNode


def status(core: MasterCore, seg: str) -> DrainStatus:
    r = core.handle(Drain(client=seg.split("/")[0], segment=seg))
    assert isinstance(r, DrainStatus), r
    return r


def failover(core: MasterCore, hub: replication.ReplicationHub, standby: MasterCore) -> None:
    for _, msg in hub.publish():
        standby.replication.apply_entries(msg.entries)
    standby.replication.take_over()


def leader_and_standby(segs: int = 3) -> tuple[MasterCore, replication.ReplicationHub,
                                               MasterCore]:
    core = make(segs=segs)
    hub = replication.ReplicationHub(core.replication, 1.0)
    standby = MasterCore(core.cfg, VirtualClock(9000.0))
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    return core, hub, standby


def test_stale_task_done_after_failover_matches_no_new_task() -> None:
    core, hub, standby = leader_and_standby()
    put(core, "k", "n0/dram")
    drain(core, "n0/dram")
    (owner, old), = tasks(core)
    failover(core, hub, standby)
    put(standby, "x", "n1/dram", "n2/dram")
    assert drain(standby, "n0/dram") == 1  # the node asks the new leader again
    (owner2, new), = tasks(standby)
    assert new.task != old.task and new.task > 1 << 48  # ids never reused across leaders
    assert (new.dst_segment, new.dst_offset) != (old.dst_segment, old.dst_offset)
    done(standby, owner, old)  # the old leader's late answer: its id is unknown here
    assert holders(standby, "k") == ["n0/dram"] and new.task in standby.tasks.tasks
    done(standby, "n1", new)  # an answer from a node the task was not sent to: ignored
    assert holders(standby, "k") == ["n0/dram"] and new.task in standby.tasks.tasks
    done(standby, owner2, new)
    assert holders(standby, "k") == [new.dst_segment, "n0/dram"]


def test_take_over_fences_the_destinations_of_tasks_in_flight() -> None:
    core, hub, standby = leader_and_standby(segs=2)
    put(core, "k", "n0/dram", size=60 * KiB)
    drain(core, "n0/dram")
    (owner, t), = tasks(core)  # writing n1/dram 0..60 KiB when the leader dies
    assert core.log[-1] == ["task", t.task, core.seg_by_name["n1/dram"], 0, 60 * KiB,
                            core.cfg.put_timeout_s]
    failover(core, hub, standby)
    assert used(standby, "n1/dram") == 60 * KiB  # not free: the old task may still write
    assert standby.stats().values["quarantined_bytes"] == 60 * KiB
    r = standby.handle(m.PutStart(client="c", item=m.PutItem(key="new", size=8 * KiB)))
    assert r.code == m.Code.NO_SPACE  # nothing may be placed over the old task's range
    cfg = standby.cfg
    for _ in range(4):  # the nodes keep their sessions while the fence runs out
        standby.clock.advance_to(standby.clock.now() + cfg.put_timeout_s / 3)
        for n in ("n0", "n1", "c"):
            standby.handle(m.Heartbeat(client=n))
        standby.tick()
    assert used(standby, "n1/dram") == 0 and standby.stats().values["quarantined_bytes"] == 0


def test_snapshot_carries_tasks_in_flight_and_task_end_clears_them() -> None:
    core = make(segs=2)
    hub = replication.ReplicationHub(core.replication, 1.0)
    put(core, "k", "n0/dram")
    put(core, "j", "n0/dram")
    drain(core, "n0/dram")
    first, second = tasks(core)
    standby = MasterCore(core.cfg, VirtualClock(9000.0))
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert sorted(standby.fence.inflight) == [first[1].task, second[1].task]
    done(core, *first)  # ends without a fence on the standby
    done(core, second[0], second[1], ok=False)  # a failed migration: fenced there too
    for _, msg in hub.publish():
        standby.replication.apply_entries(msg.entries)
    assert standby.fence.inflight == {}
    assert len(standby.fence.quarantine) == 1


def test_drain_waits_for_readers_leasing_the_draining_replica() -> None:
    core = make(segs=2, lease_ttl_s=5.0)
    put(core, "k", "n0/dram")
    assert core.handle(m.GetReplicas(key="k")).replicas  # a reader copies from n0
    assert status(core, "n0/dram") == DrainStatus(at_risk=1, leased=-1, keys=["k"])
    (owner, t), = tasks(core)
    done(core, owner, t)
    assert status(core, "n0/dram") == DrainStatus(at_risk=0, leased=1)  # still reading
    core.tick()
    assert "n0/dram" in holders(core, "k")
    core.clock.advance_to(core.clock.now() + 5.0)
    core.tick()  # lease over: eviction's drain pass drops the draining replica
    assert holders(core, "k") == ["n1/dram"]
    assert status(core, "n0/dram") == DrainStatus(at_risk=0, leased=0)


class NoWalk(dict):
    """An object dict that fails the test when something walks it."""

    def items(self):  # type: ignore[override]
        raise AssertionError("walked every object")

    def __iter__(self):
        raise AssertionError("walked every object")


def test_drain_requests_and_ticks_walk_only_the_draining_segments_keys() -> None:
    core = make(segs=3, dram=4096 * KiB)
    for i in range(200):
        put(core, f"other{i}", "n1/dram", size=KiB)
    for i in range(6):
        put(core, f"k{i}", "n0/dram", size=KiB)
    put(core, "dup", "n0/dram", "n2/dram", size=KiB)
    assert drain(core, "n0/dram") == 6  # the index is built here, once
    core.objects.objs = NoWalk(core.objs)
    assert drain(core, "n0/dram") == 6
    for owner, t in tasks(core):
        done(core, owner, t)
    core.tick()
    assert drain(core, "n0/dram") == 0 and holders(core, "dup") == ["n2/dram"]
    assert used(core, "n0/dram") == 0  # unleased: every draining replica dropped


class NoLookup(dict):
    """An object dict that fails the test when a key is looked up."""

    def get(self, key, default=None):  # type: ignore[override]
        raise AssertionError(f"looked up {key!r}")


def test_pump_returns_at_once_when_no_segment_has_room() -> None:
    core = make(segs=2, dram=16 * KiB, high_watermark=1.0)  # full, yet nothing is evicted
    for i in range(4):
        put(core, f"k{i}", "n0/dram")
    put(core, "fill", "n1/dram", size=16 * KiB)
    assert drain(core, "n0/dram") == 4 and tasks(core) == []
    assert len(core.migrations.queue) == 4 and core.migrations.min_size == 4 * KiB
    objs = core.objs
    core.objects.objs = NoLookup(objs)
    assert core.migrations.pump() == 0  # the queue is not even looked through
    core.objects.objs = objs
    core.tick()
    core.handle(m.Remove(key="fill"))
    core.tick()
    assert len(tasks(core)) == 4


def test_reading_an_ssd_only_value_on_a_draining_node_copies_it_elsewhere() -> None:
    core = make(segs=2, ssd=64 * KiB)
    put(core, "k", "n0/dram")
    o = core.objs["k"]
    ssd = core.seg_by_name["n0/ssd"]
    off = core.segs[ssd].alloc.alloc(o.size)
    core.segs[core.seg_by_name["n0/dram"]].alloc.free_range(o.reps[0][1], o.size)
    o.reps = ((ssd, off),)  # offloaded: only on n0's SSD
    status(core, "n0/dram")
    status(core, "n0/ssd")
    (owner, t), = tasks(core)  # the drain's own migration, from the SSD file
    assert (owner, t.kind, t.src_segment, t.dst_segment) == ("n0", MIGRATE, "n0/ssd", "n1/dram")
    assert core.handle(m.GetReplicas(key="k"), waiter="r1") is None  # waits for the copy
    done(core, owner, t)
    (waiter, reply), = core.ready
    assert waiter == "r1" and [r.segment for r in reply.replicas] == ["n1/dram"]


def test_reading_an_ssd_only_value_starts_its_copy_when_none_is_in_flight() -> None:
    core = make(segs=2, ssd=64 * KiB)
    put(core, "k", "n0/dram")
    o = core.objs["k"]
    ssd = core.seg_by_name["n0/ssd"]
    off = core.segs[ssd].alloc.alloc(o.size)
    core.segs[core.seg_by_name["n0/dram"]].alloc.free_range(o.reps[0][1], o.size)
    o.reps = ((ssd, off),)
    core.handle(Drain(client="n0", segment="n0/dram"))  # only DRAM drains: k is not at risk
    assert tasks(core) == []
    assert core.handle(m.GetReplicas(key="k"), waiter="r1") is None  # was NO_SPACE
    (owner, t), = tasks(core)
    assert (owner, t.kind, t.src_segment, t.dst_segment) == ("n0", MIGRATE, "n0/ssd", "n1/dram")
    done(core, owner, t)
    (waiter, reply), = core.ready
    assert [r.segment for r in reply.replicas] == ["n1/dram"]
    assert holders(core, "k") == ["n1/dram", "n0/ssd"]


class FlakyMaster:
    """Answers `Drain` from a script: an exception instance is raised, a message returned."""

    def __init__(self, script: list[object]) -> None:
        self.script = script
        self.calls = 0
        self.deadline = float("inf")

    def call(self, msg: m.Message) -> m.Message:
        assert isinstance(msg, Drain)
        self.calls += 1
        r = self.script.pop(0) if self.script else DrainStatus(at_risk=0, leased=0)
        if isinstance(r, Exception):
            raise r
        return r  # type: ignore[return-value]


def bare_node(conn: FlakyMaster) -> StorageNode:
    """A `StorageNode` without engine or sockets: enough for `drain`'s loop."""
    node = StorageNode.__new__(StorageNode)
    node.name = node.client_id = "n0"
    node.incarnation = "i0"
    node.ccfg = ClientConfig(heartbeat_s=60.0)
    node.conn = conn  # type: ignore[assignment]
    node.mounts = lambda: [Mount(client="n0", segment="n0/dram", size=1, node="n0")]  # type: ignore[method-assign]
    node._step = lambda next_hb, wait_s=0.05: (time.sleep(min(wait_s, 0.01)), next_hb)[1]  # type: ignore[method-assign]
    return node


def test_node_drain_survives_failed_rounds_and_waits_for_leases() -> None:
    conn = FlakyMaster([StoreError("master failing over"), DrainStatus(at_risk=2, leased=-1),
                        StoreError("rpc timeout"), DrainStatus(at_risk=0, leased=1)])
    assert bare_node(conn).drain(10.0) == 0
    assert conn.calls == 5  # went on past both failures and the leased round


def test_node_drain_gives_up_at_its_deadline() -> None:
    conn = FlakyMaster([StoreError("down")] * 1000)
    t0 = time.monotonic()
    assert bare_node(conn).drain(0.5) == -1  # never answered: unknown, not "nothing lost"
    assert 0.5 <= time.monotonic() - t0 < 3.0
