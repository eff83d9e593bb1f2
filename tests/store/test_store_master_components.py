"""Master components tested alone (issue 28): each is built from the few it depends on, without
a `MasterCore`, and its rules are checked on its own state."""

from __future__ import annotations

import random

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.leases import Leases
from yuebing.store.master.objects import Objects
from yuebing.store.master.reservations import Reservations
from yuebing.store.master.segments import Segments
from yuebing.store.master.sessions import Sessions
from yuebing.store.master.state import ObjState, SegState

KiB = 1024
CFG = MasterConfig(alignment=1024, lease_ttl_s=5.0)


def segments(n: int = 3) -> tuple[Segments, Effects]:
    fx = Effects()
    segs = Segments(CFG, random.Random(0), fx)
    for i in range(n):
        segs.add(i + 1, f"n{i}/dram", 64 * KiB, 0, f"n{i}", f"n{i}", OffsetAllocator(64 * KiB, 1024))
    return segs, fx


def test_segments_place_on_distinct_active_segments_and_skip_suspected_ones() -> None:
    segs, fx = segments()
    segs.suspect(["n1/dram", "nope/dram"])
    assert segs.segs[2].state == SegState.SUSPECT and fx.counters["suspects"] == 1
    placed = segs.place("c", m.PutItem(key="k", size=4 * KiB, replicas=2), least=2)
    assert sorted(sid for sid, _ in placed) == [1, 3] and segs.active_dram() == 2
    assert segs.place("c", m.PutItem(key="k", size=4 * KiB, replicas=3), least=3) == []
    assert segs.usage()["dram_used"] == 8 * KiB  # the failed try freed what it took


def test_sessions_retire_a_restarted_nodes_segments_and_refuse_the_old_process() -> None:
    segs, fx = segments(1)
    sessions = Sessions(CFG, VirtualClock(100.0), segs, fx)
    sessions.add_segment("n0", 1, "a")
    old = sessions.on_mount(Mount(client="n0", segment="n0/dram", size=64 * KiB, incarnation="b"))
    assert old == [segs.segs[1]] and fx.counters["dead_sessions"] == 1
    refused = sessions.heartbeat(m.Heartbeat(client="n0", incarnation="a"))
    assert isinstance(refused, m.Err) and refused.code == m.Code.EXISTS


def test_objects_and_leases_without_a_core() -> None:
    clock = VirtualClock(100.0)
    segs, fx = segments(1)
    fx.log = []
    fence = WriteFence(CFG, clock, segs, fx)
    objects = Objects(CFG, clock, segs, fence, Reservations(), fx)
    placed = segs.place("c", m.PutItem(key="k", size=4 * KiB), least=1)
    objects.add("c", m.PutItem(key="k", size=4 * KiB), placed)
    assert objects.end("c", "k") == (m.Code.OK, "") and objects.objs["k"].state == ObjState.COMMITTED
    leases = Leases(CFG, clock, objects)
    lid = leases.grant("k", objects.objs["k"])
    assert leases.grant("k", objects.objs["k"]) == lid and leases.open["k"][0] == 2
    leases.release(m.ReleaseLeases(keys=["k", "k"], ids=[lid, lid]))
    assert objects.objs["k"].lease == 0.0 and leases.open == {}
    objects.drop("k", objects.objs["k"])
    assert [e[0] for e in fx.log] == ["put", "commit", "del"] and segs.usage()["dram_used"] == 0
