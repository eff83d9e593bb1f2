"""The master's write fence (virtual clock): space of a put that ended uncommitted is handed to
no other put until its write expiry + write grace + fence, then it is; committed values are
freed at once; quarantines survive snapshots and a standby's take-over."""

from __future__ import annotations

import pytest

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024
SEG = 8 * KiB


def make(clock: VirtualClock, **cfg: float) -> MasterCore:
    core = MasterCore(MasterConfig(alignment=1024, put_timeout_s=10.0, **cfg), clock)  # type: ignore[arg-type]
    assert core.handle(Mount(client="n0", segment="n0/dram", size=SEG)) == m.Ok()
    return core


def start(core: MasterCore, key: str, client: str = "c", timeout_s: float = 0.0) -> m.Message:
    return core.handle(m.PutStart(client=client, item=m.PutItem(key=key, size=SEG,
                                                                  timeout_s=timeout_s)))


def test_expiry_is_the_shorter_of_put_timeout_and_the_clients_and_bad_ones_are_refused() -> None:
    core = make(VirtualClock(100.0))
    assert start(core, "a", timeout_s=3.0).expires_in_s == 3.0
    core.handle(m.PutRevoke(client="c", key="a"))
    r = core.handle(m.BatchPutStart(client="c", items=[
        m.PutItem(key="b", size=KiB, timeout_s=50.0), m.PutItem(key="x", size=1, timeout_s=-1)]))
    assert r.codes[1] == C.BAD_REQUEST and "timeout_s" in core.handle(m.PutStart(
        client="c", item=m.PutItem(key="y", size=1, timeout_s=float("nan")))).message
    assert r.codes[0] == C.NO_SPACE  # "a"'s 8 KiB are quarantined: the segment is full
    assert core.stats().values["quarantined_bytes"] == SEG


@pytest.mark.parametrize("end", ["revoke", "zombie", "session"])
def test_uncommitted_space_is_reused_only_after_the_fence(end: str) -> None:
    clock = VirtualClock(100.0)
    core = make(clock, write_grace_s=1.0, fence_s=2.0, client_ttl_s=4.0)
    t = start(core, "a", timeout_s=5.0 if end == "revoke" else 0.0)
    assert t.replicas == [m.Replica(segment="n0/dram", offset=0)]
    if end == "revoke":
        assert t.expires_in_s == 5.0
        assert core.handle(m.PutRevoke(client="c", key="a")) == m.Ok()
        fence_at = 100.0 + 5.0 + 1.0 + 2.0
    else:  # never ended: a zombie after put_timeout_s, or its client's session expires
        assert t.expires_in_s == 10.0
        fence_at = 100.0 + 10.0 + 1.0 + 2.0
        for now in (103.0, 106.0, 109.0, 110.5):
            clock.advance_to(now)
            core.handle(m.Heartbeat(client="n0"))
            if end == "zombie":
                core.handle(m.Heartbeat(client="c"))
            core.tick()
        assert core.counters["zombies" if end == "zombie" else "dead_sessions"] == 1
    assert "a" not in core.objs and core.counters["quarantined"] == 1
    clock.advance_to(fence_at - 0.01)
    core.handle(m.Heartbeat(client="n0"))
    core.tick()
    assert start(core, "b", client="d").code == C.NO_SPACE  # the range is still fenced
    assert core.stats().values["dram_used"] == SEG
    assert core.stats().values["quarantined_bytes"] == SEG
    clock.advance_to(fence_at + 0.01)
    core.tick()
    assert core.stats().values["quarantined_bytes"] == 0
    assert start(core, "b", client="d").replicas == [m.Replica(segment="n0/dram", offset=0)]


def test_committed_values_are_freed_at_once() -> None:
    core = make(VirtualClock(100.0))
    start(core, "a")
    core.handle(m.PutEnd(client="c", key="a"))
    assert core.handle(m.Remove(key="a")) == m.Ok()
    assert core.stats().values["dram_used"] == 0 and core.counters["quarantined"] == 0


def test_quarantine_survives_snapshot_and_take_over() -> None:
    clock = VirtualClock(100.0)
    leader = make(clock)
    leader.log = []
    start(leader, "a", timeout_s=5.0)
    blob = leader.replication.snapshot()
    standby = MasterCore(leader.cfg, VirtualClock(500.0))  # another host's clock
    standby.replication.load_snapshot(blob)
    leader.log = []
    leader.handle(m.PutRevoke(client="c", key="a"))  # quarantined on the leader ...
    standby.replication.apply_entries(leader.log)  # ... and, conservatively, on the standby
    assert standby.fence.quarantine.ranges(1) == [(0, SEG)]
    snap_standby = MasterCore(leader.cfg, VirtualClock(900.0))
    snap_standby.replication.load_snapshot(leader.replication.snapshot())
    for core, clk in ((standby, standby.clock), (snap_standby, snap_standby.clock)):
        core.replication.take_over()
        assert start(core, "b", client="d").code == C.NO_SPACE
        for _ in range(4):  # the standby's fence: its own now + put_timeout_s + 3 s at most
            clk.advance_to(clk.now() + 4.0)  # type: ignore[attr-defined]
            core.handle(m.Heartbeat(client="n0"))
            core.tick()
        assert start(core, "b", client="d").replicas[0].offset == 0


def test_take_over_drops_a_quarantined_range_the_leader_already_reused() -> None:
    clock = VirtualClock(100.0)
    leader = make(clock, write_grace_s=0.0, fence_s=0.0)
    leader.log = []
    standby = MasterCore(leader.cfg, VirtualClock(100.0))
    standby.replication.load_snapshot(leader.replication.snapshot())
    start(leader, "a", timeout_s=1.0)
    leader.handle(m.PutRevoke(client="c", key="a"))
    clock.advance_to(101.5)
    leader.tick()  # the leader's fence is over: it hands the range to "b"
    assert start(leader, "b", client="d").replicas[0].offset == 0
    standby.replication.apply_entries(leader.log)  # the standby's fence is not over yet
    standby.replication.take_over()  # no overlap error; "b" holds the range
    assert standby.segs[1].alloc.used == SEG and len(standby.fence.quarantine) == 0
    standby.tick()
    assert standby.segs[1].alloc.used == SEG


def two_segments(clock: VirtualClock, **cfg: float) -> MasterCore:
    core = make(clock, **cfg)
    assert core.handle(Mount(client="n1", segment="n1/dram", size=SEG)) == m.Ok()
    return core


def test_watermark_does_not_evict_for_quarantined_bytes() -> None:
    core = two_segments(VirtualClock(100.0), high_watermark=0.5, evict_ratio=0.25)
    start(core, "v")
    assert core.handle(m.PutEnd(client="c", key="v")) == m.Ok()
    start(core, "a", timeout_s=5.0)
    core.handle(m.PutRevoke(client="c", key="a"))  # e.g. revoked with its client's session
    assert core.stats().values["dram_used"] == 2 * SEG  # over the watermark, half quarantined
    core.tick()
    assert "v" in core.objs and core.counters["evictions"] == 0
    assert core.fence.quarantine.held(core.seg_by_name["n0/dram"]) + core.fence.quarantine.held(
        core.seg_by_name["n1/dram"]) == SEG


def test_a_failed_allocation_releases_due_quarantine_before_it_evicts() -> None:
    clock = VirtualClock(100.0)
    core = two_segments(clock, write_grace_s=1.0, fence_s=2.0)
    start(core, "v")
    core.handle(m.PutEnd(client="c", key="v"))
    a = start(core, "a", timeout_s=1.0).replicas
    core.handle(m.PutRevoke(client="c", key="a"))
    clock.advance_to(104.5)  # the fence is over, no tick yet
    assert start(core, "b", client="d").replicas == a  # the released range, not v's
    assert "v" in core.objs and core.counters["evictions"] == 0


def partitioned_node(clock: VirtualClock) -> MasterCore:
    """n0 (16 KiB) holds a pending put "a" (fence 113) and a revoked one "r" (fence 105); its
    session expires at 104.5 while it is alive, and it mounts the same segment again."""
    core = MasterCore(MasterConfig(alignment=1024, put_timeout_s=10.0, client_ttl_s=4.0,
                                   write_grace_s=1.0, fence_s=2.0), clock)
    core.log = []
    assert core.handle(Mount(client="n0", segment="n0/dram", size=2 * SEG)) == m.Ok()
    assert start(core, "a").replicas[0].offset == 0
    assert start(core, "r", timeout_s=2.0).replicas[0].offset == SEG
    core.handle(m.PutRevoke(client="c", key="r"))
    clock.advance_to(104.5)
    core.handle(m.Heartbeat(client="c"))
    core.tick()
    assert core.counters["dead_sessions"] == 1 and "n0/dram" not in core.seg_by_name
    return core


def test_a_remounted_segment_keeps_the_fence_of_its_dropped_id() -> None:
    clock = VirtualClock(100.0)
    core = partitioned_node(clock)
    assert core.handle(Mount(client="n0", segment="n0/dram", size=2 * SEG)) == m.Ok()
    sid = core.seg_by_name["n0/dram"]
    assert sorted(core.fence.quarantine.ranges(sid)) == [(0, SEG), (SEG, SEG)]
    assert core.stats().values["quarantined_bytes"] == 2 * SEG
    assert start(core, "b", client="d").code == C.NO_SPACE  # a late frame of "a" may land
    for now, free_at in ((105.5, SEG), (113.5, 0)):  # "r"'s fence, then "a"'s
        clock.advance_to(now)
        core.handle(m.Heartbeat(client="n0"))
        core.tick()
        assert start(core, f"b{now}", client="d").replicas[0].offset == free_at
        assert core.handle(m.PutEnd(client="d", key=f"b{now}")) == m.Ok()
    assert len(core.fence.quarantine) == 0 and core.stats().values["dram_used"] == 2 * SEG


def test_a_smaller_remount_keeps_only_the_ranges_inside_it() -> None:
    core = partitioned_node(VirtualClock(100.0))
    assert core.handle(Mount(client="n0", segment="n0/dram", size=SEG + 100)) == m.Ok()
    assert core.fence.quarantine.ranges(core.seg_by_name["n0/dram"]) == [(0, SEG)]
    assert core.stats().values["dram_used"] == SEG


def test_the_fence_of_a_dropped_segment_survives_snapshot_and_take_over() -> None:
    clock = VirtualClock(100.0)
    leader = partitioned_node(clock)
    standby = MasterCore(leader.cfg, VirtualClock(500.0))
    standby.replication.load_snapshot(leader.replication.snapshot())  # "n0/dram" by name
    leader.log = []
    leader.handle(Mount(client="n0", segment="n0/dram", size=2 * SEG))
    standby.replication.apply_entries(leader.log)
    sid = standby.seg_by_name["n0/dram"]
    assert sorted(standby.fence.quarantine.ranges(sid)) == [(0, SEG), (SEG, SEG)]
    standby.replication.take_over()
    assert standby.segs[sid].alloc.used == 2 * SEG
    assert start(standby, "b", client="d").code == C.NO_SPACE
    standby.clock.advance_to(509.0)  # type: ignore[attr-defined]  # past 113 - 104.5 s
    standby.handle(m.Heartbeat(client="n0"))
    standby.tick()
    assert start(standby, "b", client="d").replicas[0].offset == 0


def test_quarantine_load_refuses_malformed_entries() -> None:
    core = make(VirtualClock(100.0))
    with pytest.raises(ValueError, match="4 or 5 items"):
        core.fence.quarantine.load(100.0, [[1.0, 1, 0]])
