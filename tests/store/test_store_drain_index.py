"""The master core's per-draining-segment key index: a re-elected leader rebuilds it instead of
using a stale one, and a tick's drain pass keeps every draining replica a reader may hold while
two segments drain (virtual clock, no sockets)."""

from __future__ import annotations

from drain_factories import done, drain, holders, make, put, tasks

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, Unmount
from yuebing.store.master.core import MasterCore


def test_a_re_elected_leader_does_not_use_its_stale_drain_index() -> None:
    l1 = make(segs=2)
    put(l1, "v", "n0/dram", "n1/dram")
    assert drain(l1, "n0/dram") == 0  # v is spare: a copy on n1
    l2 = MasterCore(l1.cfg, VirtualClock(500.0))  # follows l1, then takes over
    l2.replication.load_snapshot(l1.replication.snapshot())
    l2.replication.take_over()
    l2.handle(m.Heartbeat(client="n0"))
    assert l2.handle(Unmount(client="n1", segment="n1/dram")) == m.Ok()  # v only on n0 now
    assert drain(l2, "n0/dram") == 1
    tasks(l2)
    l1.log = None  # l1 re-syncs from l2 as a standby and is elected again
    l1.replication.load_snapshot(l2.replication.snapshot())
    l1.replication.take_over()
    assert holders(l1, "v") == ["n0/dram"]
    assert drain(l1, "n0/dram") == 1  # at risk: the node waits instead of unmounting with v


def test_rolling_drain_keeps_the_replica_a_reader_was_given() -> None:
    core = make(segs=3)
    put(core, "v", "n0/dram", "n1/dram")
    drain(core, "n0/dram")
    core.clock.advance_to(core.clock.now() + 0.5)  # type: ignore[attr-defined]
    got = core.handle(m.GetReplicas(key="v"))
    assert [x.segment for x in got.replicas] == ["n1/dram"]  # type: ignore[union-attr]
    core.clock.advance_to(core.clock.now() + 0.5)  # type: ignore[attr-defined]
    assert drain(core, "n1/dram") == 1  # now both copies drain: migrated to n2
    (owner, t), = tasks(core)
    done(core, owner, t)
    core.eviction.drain()
    assert "n1/dram" in holders(core, "v")  # the reader's replica stays while it may copy
    st = core.handle(Drain(client="n1", segment="n1/dram"))
    assert st.leased == 1  # type: ignore[union-attr]
