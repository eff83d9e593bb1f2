"""A node's session is identified by its incarnation (a fresh id per process), not by its name:
a node restarted under the same ``--name`` within the session TTL retires its previous
process's segments at once — capacity is not double counted, no put is placed on a dead
segment, and a heartbeat of the new process does not revive the old one's segments (issue 15,
item 2). Core rules with a virtual clock, then real processes (``kill -9``, restart)."""

from __future__ import annotations

import pytest

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, Mount, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024


def make() -> MasterCore:
    return MasterCore(MasterConfig(alignment=1024), VirtualClock(100.0))


def mount(core: MasterCore, seg: str, inc: str, client: str = "n0") -> m.Message:
    return core.handle(Mount(client=client, segment=seg, size=16 * KiB, incarnation=inc))


def put(core: MasterCore, key: str) -> m.Message:
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key=key, size=KiB)))
    assert isinstance(t, m.PutTargets), t
    assert core.handle(m.PutEnd(client="c", key=key)) == m.Ok()
    return t


def test_a_restarted_node_retires_its_previous_segments_at_once() -> None:
    core = make()
    assert mount(core, "host:1/n0.dram", "a") == m.Ok()
    put(core, "old")
    core.handle(m.PutRevoke(client="c", key="x", failed=["host:1/n0.dram"]))  # suspected
    assert mount(core, "host:2/n0.dram", "b") == m.Ok()  # same name, new process
    assert list(core.seg_by_name) == ["host:2/n0.dram"]
    assert core.stats().values["dram_capacity"] == 16 * KiB
    assert core.handle(m.Exists(key="old")) == m.Bools(values=[False])  # its only replica died
    t = put(core, "new")
    assert [r.segment for r in t.replicas] == ["host:2/n0.dram"]
    hb = core.handle(m.Heartbeat(client="n0", incarnation="b"))
    assert hb == m.HeartbeatReply(segments=["host:2/n0.dram"])


def test_same_segment_name_from_a_new_process_is_a_fresh_mount() -> None:
    """With etcd metadata a segment's name has no port: the restarted node mounts the very
    same name. Its memory is new, so the old mount's values must not stay readable there."""
    core = make()
    assert mount(core, "n0.dram", "a") == m.Ok()
    put(core, "old")
    assert mount(core, "n0.dram", "b") == m.Ok()
    assert core.handle(m.Exists(key="old")) == m.Bools(values=[False])
    assert core.segs[core.seg_by_name["n0.dram"]].incarnation == "b"
    assert mount(core, "n0.dram", "b") == m.Ok()  # the same process mounting again: idempotent


def test_a_retired_process_is_refused_and_cannot_unmount_its_successor() -> None:
    core = make()
    mount(core, "n0.dram", "a")
    mount(core, "n0.dram", "b")
    for msg in (m.Heartbeat(client="n0", incarnation="a"),
                Mount(client="n0", segment="n0.dram", size=16 * KiB, incarnation="a")):
        r = core.handle(msg)
        assert isinstance(r, m.Err) and r.code == C.EXISTS
        assert "taken over by a newer process (incarnation b; this one, a, is retired)" in r.message
    r = core.handle(Unmount(client="n0", segment="n0.dram", incarnation="a"))
    assert isinstance(r, m.Err) and r.code == C.UNKNOWN_SEGMENT
    r = core.handle(Drain(client="n0", segment="n0.dram", incarnation="a"))
    assert isinstance(r, m.Err) and r.code == C.UNKNOWN_SEGMENT
    assert list(core.seg_by_name) == ["n0.dram"]


def test_without_incarnations_the_name_only_rules_stay() -> None:
    core = make()
    assert core.handle(Mount(client="n0", segment="s1", size=16 * KiB)) == m.Ok()
    assert core.handle(Mount(client="n0", segment="s2", size=16 * KiB)) == m.Ok()
    assert sorted(core.seg_by_name) == ["s1", "s2"]
    assert core.handle(m.Heartbeat(client="n0")) == m.HeartbeatReply(segments=["s1", "s2"])


def test_a_standby_knows_each_segment_s_incarnation() -> None:
    leader = make()
    leader.log = []
    mount(leader, "n0.dram", "a")
    standby = make()
    standby.replication.load_snapshot(leader.replication.snapshot())
    standby.replication.apply_entries(leader.log)
    leader.log = []
    mount(leader, "n0.dram", "b")
    standby.replication.apply_entries(leader.log)
    standby.replication.take_over()
    assert standby.segs[standby.seg_by_name["n0.dram"]].incarnation == "b"
    assert standby.sessions.sessions["n0"].incarnation == "b"


# ---------------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_node_killed_and_restarted_under_its_name_within_the_ttl() -> None:
    from store_procs import master, node

    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig

    mst = master("--client-ttl-s", "30")
    first = second = None
    try:
        addr = mst.info["address"]
        first = node(addr, "8MiB", "--name", "n-restart")
        c = StoreClient(ClientConfig(master=addr, checksum=True, put_retries=0))
        try:
            for i in range(4):
                c.put(f"old/{i}", bytes([i]) * 100_000)
            first.kill()  # kill -9, then a new process under the same name within the TTL
            second = node(addr, "8MiB", "--name", "n-restart")
            s = c.stats()
            assert s["segments"] == 1 and s["dram_capacity"] == 8 << 20
            assert c.batch_exists([f"old/{i}" for i in range(4)]) == [False] * 4
            for i in range(20):  # every put lands on the live segment (none on the dead one)
                c.put(f"new/{i}", bytes([i]) * 100_000)
                assert c.get(f"new/{i}") == bytes([i]) * 100_000
            assert c.stats()["suspects"] == 0
        finally:
            c.close()
    finally:
        for p in (second, first, mst):
            if p is not None:
                p.stop()
