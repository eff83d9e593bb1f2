"""``replicas=N``: a put that cannot place N copies on distinct DRAM segments is refused with a
precise NO_SPACE and leaves nothing allocated; ``min_replicas`` (the client's ``best_effort``)
accepts fewer and the reply shows how many were placed (issue 15, item 11)."""

from __future__ import annotations

from yuebing.core.clock import VirtualClock
from yuebing.store import messages as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024


def make(segs: int, dram: int = 16 * KiB) -> MasterCore:
    core = MasterCore(MasterConfig(alignment=1024), VirtualClock(100.0))
    for i in range(segs):
        assert core.handle(m.Mount(client=f"n{i}", segment=f"n{i}/dram", size=dram)) == m.Ok()
    return core


def used(core: MasterCore) -> float:
    return core.stats().values["dram_used"]


def start(core: MasterCore, key: str, **kw: object) -> m.Message:
    return core.handle(m.PutStart(client="c", item=m.PutItem(key=key, size=KiB, **kw)))


def test_more_replicas_than_segments_is_refused_with_a_precise_error() -> None:
    core = make(segs=3)
    r = start(core, "k", replicas=4)
    assert isinstance(r, m.Err) and r.code == C.NO_SPACE
    assert r.message == ("'k' needs 4 replicas on distinct DRAM segments but only 3 DRAM "
                         "segments take puts (put with best_effort to accept fewer)")
    assert used(core) == 0 and "k" not in core.objs


def test_best_effort_accepts_fewer_and_reports_them() -> None:
    core = make(segs=3)
    r = start(core, "k", replicas=4, min_replicas=1)
    assert isinstance(r, m.PutTargets) and len(r.replicas) == 3
    assert used(core) == 3 * KiB


def test_a_tight_cluster_refuses_rather_than_storing_fewer_copies() -> None:
    core = make(segs=2)
    for i in range(16):  # n0 full of hard-pinned values (nothing to evict)
        r = core.handle(m.PutStart(client="c", item=m.PutItem(
            key=f"f{i}", size=KiB, strategy="preferred", preferred=["n0/dram"], hard_pin=True)))
        assert isinstance(r, m.PutTargets) and r.replicas[0].segment == "n0/dram"
        assert core.handle(m.PutEnd(client="c", key=f"f{i}")) == m.Ok()
    before = used(core)
    r = start(core, "two", replicas=2)
    assert isinstance(r, m.Err) and r.code == C.NO_SPACE
    assert "fewer than 2 of the 2 DRAM segments have 1024 free bytes" in r.message
    assert used(core) == before  # the copy placed on n1 was given back
    r = start(core, "two", replicas=2, min_replicas=1)
    assert isinstance(r, m.PutTargets) and [x.segment for x in r.replicas] == ["n1/dram"]


def test_min_replicas_above_replicas_is_a_bad_request() -> None:
    core = make(segs=2)
    r = start(core, "k", replicas=1, min_replicas=2)
    assert isinstance(r, m.Err) and r.code == C.BAD_REQUEST
    assert r.message == "min_replicas must be 0..replicas (1), got 2"
