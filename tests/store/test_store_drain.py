"""Drain migrations in the master core (no sockets, virtual clock): values whose every replica is
on a draining segment are copied to an active DRAM segment before the node unmounts."""

from __future__ import annotations

import pytest
from drain_factories import MIGRATE, KiB, done, drain, holders, make, put, tasks, used

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind, TaskKind, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master import replication
from yuebing.store.master.core import MasterCore
from yuebing.store.master.migration import MAX_ATTEMPTS

C = m.Code


def test_sole_copies_migrate_replicated_values_are_not_copied() -> None:
    core = make()
    put(core, "solo", "n0/dram")
    put(core, "dup", "n0/dram", "n1/dram")
    put(core, "other", "n2/dram")
    core.events.clear()
    assert drain(core, "n0/dram") == 1  # only "solo" would be lost
    (owner, t), = tasks(core)
    assert (owner, t.kind, t.src_segment, t.size) == ("n0", MIGRATE, "n0/dram", 4 * KiB)
    assert t.dst_segment == "n1/dram"  # not n0; n1 and n2 equally free: the first one
    assert drain(core, "n0/dram") == 1 and tasks(core) == []  # in flight: counted, not restarted
    core.log.clear()
    done(core, owner, t)
    assert holders(core, "solo") == ["n1/dram", "n0/dram"]  # the copy first: new readers use it
    assert core.events == [(EventKind.STORED, "solo", ["n1/dram"])]
    assert core.log == [["reps", "solo", core.objs["solo"].reps], ["task_end", t.task, False]]
    assert drain(core, "n0/dram") == 0
    core.tick()  # nothing leased: the draining replicas go, their ranges freed
    assert holders(core, "solo") == ["n1/dram"] and holders(core, "dup") == ["n1/dram"]
    assert used(core, "n0/dram") == 0
    assert core.handle(Unmount(client="n0", segment="n0/dram")) == m.Ok()
    assert sorted(core.objs) == ["dup", "other", "solo"]
    st = core.stats().values
    assert (st["migrations_started"], st["migrations_done"], st["migrations_failed"]) == (1, 1, 0)


def test_values_whose_other_replicas_also_drain_migrate_preferably_to_another_node() -> None:
    core = make(segs=3, ssd=64 * KiB)
    put(core, "both", "n0/dram", "n1/dram")
    assert drain(core, "n0/dram") == 0
    assert drain(core, "n1/dram") == 1  # its other replica is draining too
    (owner, t), = tasks(core)
    assert owner == "n0" and t.dst_segment == "n2/dram"
    # a draining node's SSD-only value moves into another node's DRAM, read from its file
    core2 = make(segs=2, dram=8 * KiB, ssd=64 * KiB, high_watermark=0.5, evict_ratio=0.1)
    put(core2, "cold", "n0/dram")
    put(core2, "fill", "n1/dram", size=8 * KiB)
    core2.tick()  # over the watermark: both offloaded to their node's SSD
    for owner, t in tasks(core2):
        assert t.kind == TaskKind.OFFLOAD
        done(core2, owner, t)
    assert holders(core2, "cold") == ["n0/ssd"]
    assert drain(core2, "n0/dram") == 0
    assert drain(core2, "n0/ssd") == 1
    (owner, t), = tasks(core2)
    assert (owner, t.src_segment, t.dst_segment) == ("n0", "n0/ssd", "n1/dram")
    assert core2.handle(m.GetReplicas(key="cold"), waiter="w") is None  # waits for the copy
    done(core2, owner, t)
    (w, reply), = core2.ready
    assert w == "w" and reply.replicas == [m.Replica(segment="n1/dram", offset=t.dst_offset)]


def test_no_room_anywhere_keeps_counting_and_loses_nothing_before_unmount() -> None:
    core = make(segs=2, dram=8 * KiB, high_watermark=1.0)  # no LRU eviction in the way
    put(core, "a", "n0/dram")
    put(core, "b", "n0/dram")
    put(core, "full", "n1/dram", size=8 * KiB)
    assert drain(core, "n0/dram") == 2
    assert tasks(core) == []
    for _ in range(3):
        core.tick()
    assert drain(core, "n0/dram") == 2 and tasks(core) == []
    assert sorted(core.objs) == ["a", "b", "full"]  # not evicted while draining
    core.handle(m.Remove(key="full"))
    core.tick()  # room appeared: the queued values start moving
    assert sorted(t.dst_segment for _, t in tasks(core)) == ["n1/dram", "n1/dram"]


def test_failed_migrations_retry_elsewhere_then_give_up_without_leaking() -> None:
    core = make(segs=4, client_ttl_s=1000.0)
    put(core, "k", "n0/dram")
    drain(core, "n0/dram")
    seen = []
    for _ in range(MAX_ATTEMPTS):
        (owner, t), = tasks(core)
        seen.append(t.dst_segment)
        assert used(core, t.dst_segment) == 4 * KiB
        done(core, owner, t, ok=False)
        # its frames may still land until the task's write expiry: quarantined, not freed
        assert used(core, t.dst_segment) == 4 * KiB
        assert tasks(core) == []  # retried by the next tick, not from inside TaskDone
        core.tick()
    assert sorted(seen) == ["n1/dram", "n2/dram", "n3/dram"]  # never the same one twice
    assert tasks(core) == []
    st = core.stats().values
    assert (st["migrations_failed"], st["migrations_given_up"], st["tasks"]) == (MAX_ATTEMPTS, 1, 0)
    assert (st["quarantined"], st["quarantined_bytes"]) == (MAX_ATTEMPTS, MAX_ATTEMPTS * 4 * KiB)
    assert drain(core, "n0/dram") == 1 and tasks(core) == []  # still at risk, not restarted
    assert holders(core, "k") == ["n0/dram"]
    cfg = core.cfg  # freed once no frame can land: write expiry + grace + fence
    core.clock.advance_to(core.clock.now() + cfg.put_timeout_s + cfg.write_grace_s + cfg.fence_s)
    core.tick()
    assert [used(core, s) for s in seen] == [0, 0, 0]
    assert core.stats().values["quarantined_bytes"] == 0


def test_destination_unmounted_mid_task_goes_elsewhere() -> None:
    core = make(segs=3)
    put(core, "k", "n0/dram")
    drain(core, "n0/dram")
    (owner, t), = tasks(core)
    first = t.dst_segment
    assert core.handle(Unmount(client=first.split("/")[0], segment=first)) == m.Ok()
    assert core.stats().values["migrations_failed"] == 1
    core.tick()
    (owner, t2), = tasks(core)
    assert t2.dst_segment not in (first, "n0/dram")
    done(core, owner, t)  # the first task's late answer: unknown task, ignored
    assert holders(core, "k") == ["n0/dram"]
    done(core, owner, t2)
    assert holders(core, "k") == [t2.dst_segment, "n0/dram"]
    assert used(core, t2.dst_segment) == 4 * KiB


def test_parallel_limit_and_pins_and_leases_move_with_the_value() -> None:
    core = make(segs=2, drain_parallel=2, lease_ttl_s=1.0)
    for i in range(5):
        put(core, f"k{i}", "n0/dram", size=KiB, hard_pin=i == 0)
    core.handle(m.GetReplicas(key="k1"))  # leased
    assert drain(core, "n0/dram") == 5
    first = tasks(core)
    assert len(first) == 2 and len(core.migrations.queue) == 3
    done(core, *first[0])
    pending = first[1:] + tasks(core)
    assert len(pending) == 2  # one ended, one more started
    while pending:
        for owner, t in pending:
            done(core, owner, t)
        core.tick()
        pending = tasks(core)
        assert len(pending) <= 2
    assert drain(core, "n0/dram") == 0
    assert core.handle(m.Remove(key="k0")).code == C.PINNED  # the pin moved with it
    assert core.handle(m.Remove(key="k1")).code == C.LEASED
    assert "n0/dram" in holders(core, "k1")  # the reader's replica stays while it is leased
    core.handle(Unmount(client="n0", segment="n0/dram"))
    assert all(holders(core, f"k{i}") == ["n1/dram"] for i in range(5))


def test_standby_keeps_the_migrated_replica_after_failover() -> None:
    core = make(segs=2)
    hub = replication.ReplicationHub(core.replication, 1.0)
    put(core, "k", "n0/dram")
    standby = MasterCore(core.cfg, VirtualClock(9000.0))
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    drain(core, "n0/dram")
    (owner, t), = tasks(core)
    done(core, owner, t)
    for _, msg in hub.publish():
        standby.replication.apply_entries(msg.entries)
    standby.replication.take_over()
    standby.handle(Unmount(client="n0", segment="n0/dram"))
    assert standby.handle(m.GetReplicas(key="k")).replicas == [
        m.Replica(segment="n1/dram", offset=t.dst_offset)]


@pytest.mark.parametrize("bad", [0, -1])
def test_drain_parallel_validated(bad: int) -> None:
    from yuebing.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--drain-parallel must be >= 1"):
        MasterConfig(drain_parallel=bad)
