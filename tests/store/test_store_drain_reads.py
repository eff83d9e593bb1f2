"""Reads during a drain: a reader is given a value's replicas on draining segments only when it
has no other DRAM replica, so a hot value with a copy elsewhere does not hold the drain up; a
reader who was given a draining replica (or leased the value before the drain began) does."""

from __future__ import annotations

from drain_factories import KiB, done, drain, holders, make, put, tasks

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, DrainStatus, TaskKind

C = m.Code


def _get(core, key: str) -> list[str]:
    r = core.handle(m.GetReplicas(key=key))
    assert isinstance(r, m.ReplicaList), r
    return [x.segment for x in r.replicas]


def _status(core, seg: str) -> DrainStatus:
    r = core.handle(Drain(client=seg.split("/")[0], segment=seg))
    assert isinstance(r, DrainStatus), r
    return r


def test_hot_value_with_a_copy_elsewhere_does_not_hold_the_drain() -> None:
    core = make()
    ttl = core.cfg.lease_ttl_s
    put(core, "hot", "n0/dram", "n1/dram")
    assert sorted(_get(core, "hot")) == ["n0/dram", "n1/dram"]  # leased before the drain
    assert drain(core, "n0/dram") == 0  # not at risk: n1 holds a copy
    assert _status(core, "n0/dram").leased == 1  # that reader may be copying from n0
    t = core.clock.now()
    while core.clock.now() < t + 2 * ttl:  # read all the time: the lease never lapses
        core.clock.advance_to(core.clock.now() + ttl / 4)  # type: ignore[attr-defined]
        assert _get(core, "hot") == ["n1/dram"]  # never the draining replica
    assert core.objs["hot"].lease > core.clock.now()
    assert _status(core, "n0/dram").leased == 0
    core.eviction.drain()
    assert [core.segs[s].name for s, _ in core.objs["hot"].reps] == ["n1/dram"]


def test_a_reader_given_the_draining_replica_holds_it_until_its_lease_ends() -> None:
    core = make()
    ttl = core.cfg.lease_ttl_s
    put(core, "v", "n0/dram")
    assert drain(core, "n0/dram") == 1  # its only copy: migrated
    (owner, task), = tasks(core)
    assert _get(core, "v") == ["n0/dram"]  # read mid-migration: the draining copy is all there is
    done(core, owner, task)
    assert _get(core, "v") == [task.dst_segment]  # from now on only the new copy
    st = _status(core, "n0/dram")
    assert (st.at_risk, st.leased) == (0, 1)  # the reader given n0's copy may still copy
    core.clock.advance_to(core.clock.now() + ttl + 0.1)  # type: ignore[attr-defined]
    assert _get(core, "v") == [task.dst_segment]  # a hot value, but its reads are elsewhere
    assert _status(core, "n0/dram").leased == 0


def test_a_reader_from_before_the_drain_is_not_forgotten_when_the_value_is_read_again() -> None:
    core = make()
    ttl = core.cfg.lease_ttl_s
    put(core, "hot", "n0/dram", "n1/dram")
    assert sorted(_get(core, "hot")) == ["n0/dram", "n1/dram"]  # reader A, before the drain
    assert sorted(_get(core, "hot")) == ["n0/dram", "n1/dram"]
    assert core.leases.handed == {}  # no drain runs: reads note nothing
    t0 = core.clock.now()
    assert drain(core, "n0/dram") == 0
    core.clock.advance_to(t0 + ttl / 4)  # type: ignore[attr-defined]
    assert _get(core, "hot") == ["n1/dram"]  # reader B renews the lease
    assert _status(core, "n0/dram").leased == 1  # reader A may still copy from n0
    core.eviction.drain()
    assert sorted(holders(core, "hot")) == ["n0/dram", "n1/dram"]
    core.clock.advance_to(t0 + ttl + 0.01)  # type: ignore[attr-defined]
    assert core.objs["hot"].lease > core.clock.now()  # B's lease runs, A's is over
    assert _status(core, "n0/dram").leased == 0
    core.eviction.drain()
    assert holders(core, "hot") == ["n1/dram"]


def test_a_promotion_landing_on_a_segment_that_began_draining_holds_the_drain() -> None:
    core = make(segs=2, ssd=64 * KiB)
    ttl = core.cfg.lease_ttl_s
    put(core, "v", "n0/dram")
    o = core.objs["v"]
    core.clock.advance_to(core.clock.now() + ttl + 1)  # type: ignore[attr-defined]
    assert core.tasks.copy("v", o, o.reps[0], core.segs[core.seg_by_name["n0/ssd"]],
                               promote=False)
    done(core, *tasks(core)[0])
    assert holders(core, "v") == ["n0/ssd"]  # offloaded
    assert core.handle(m.GetReplicas(key="v"), waiter="W") is None  # promoted into n0's DRAM
    (owner, t), = tasks(core)
    assert (t.kind, t.dst_segment) == (TaskKind.PROMOTE, "n0/dram")
    assert _status(core, "n0/dram").leased == 0  # begins draining mid-promotion
    done(core, owner, t)
    (waiter, reply), = core.ready
    assert waiter == "W" and [r.segment for r in reply.replicas] == ["n0/dram"]
    assert _status(core, "n0/dram") == DrainStatus(at_risk=0, leased=1)  # W copies from n0
    core.eviction.drain()
    assert holders(core, "v") == ["n0/dram", "n0/ssd"]
    core.clock.advance_to(core.clock.now() + ttl + 0.1)  # type: ignore[attr-defined]
    assert _status(core, "n0/dram").leased == 0
    core.eviction.drain()
    assert holders(core, "v") == ["n0/ssd"]
