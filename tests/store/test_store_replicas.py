"""``replicas=N``: a put that cannot place N copies on distinct DRAM segments is refused with a
precise NO_SPACE and leaves nothing allocated; ``min_replicas`` (the client's ``best_effort``)
accepts fewer and the reply shows how many were placed (issue 15, item 11)."""

from __future__ import annotations

import pytest

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024


def make(segs: int, dram: int = 16 * KiB) -> MasterCore:
    core = MasterCore(MasterConfig(alignment=1024), VirtualClock(100.0))
    for i in range(segs):
        assert core.handle(Mount(client=f"n{i}", segment=f"n{i}/dram", size=dram)) == m.Ok()
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


@pytest.mark.slow
def test_clients_refuse_fewer_copies_unless_best_effort() -> None:
    """Real processes: two nodes, puts asking for three copies (sync, batch and async) on the
    nodes' segments (values the master would hold itself are kept off that path: a held value
    is one copy, and a small best-effort put is held — docs/store.md)."""
    import asyncio

    from store_procs import store_cluster

    from yuebing.store.client.client import AsyncStoreClient, StoreClient
    from yuebing.store.client.rpc import StoreRpcError
    from yuebing.store.config import ClientConfig

    with store_cluster("r0", "r1", dram="8MiB") as (mst, *_):
        addr = mst.info["address"]
        cfg = ClientConfig(master=addr, inline_max_bytes=0)
        with StoreClient(ClientConfig(master=addr)) as held:
            assert held.put("h", b"v" * 1000, replicas=3, best_effort=True) == 1
            held.remove("h")
        with StoreClient(cfg) as c:
            with pytest.raises(StoreRpcError) as e:
                c.put("k", b"v" * 1000, replicas=3)
            assert e.value.code == C.NO_SPACE
            assert "needs 3 replicas on distinct DRAM segments but only 2" in str(e.value)
            assert not c.exists("k") and c.stats()["dram_used"] == 0
            assert c.put("k", b"v" * 1000, replicas=3, best_effort=True) == 2
            assert c.put("k2", b"v" * 1000, replicas=2) == 2
            assert c.batch_put(["b1", "b2"], [b"x", b"y"], replicas=3) == [C.NO_SPACE] * 2

        async def aio() -> None:
            async with AsyncStoreClient(cfg) as a:
                with pytest.raises(StoreRpcError):
                    await a.put("a", b"v", replicas=3)
                assert await a.put("a", b"v", replicas=3, best_effort=True) == 2

        asyncio.run(aio())
