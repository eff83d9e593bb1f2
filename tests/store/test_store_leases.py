"""Read leases end when the reads end (issue 15, item 5): a client releases its lease once its
read is over (one-way `ReleaseLeases`), so a full cache under the put-then-get pattern does not
refuse puts with NO_SPACE until ``lease_ttl_s`` runs out, `remove` of a value read and finished
is not LEASED, and `remove_prefix` reports the keys it kept. Core rules with a virtual clock,
then a real master and node."""

from __future__ import annotations

import time

import pytest

from yuebing.core.clock import VirtualClock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.config import MasterConfig
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024


def make(dram: int = 8 * KiB) -> tuple[MasterCore, VirtualClock]:
    clock = VirtualClock(100.0)
    core = MasterCore(MasterConfig(alignment=1024, lease_ttl_s=5.0, room_wait_s=0.0), clock)
    assert core.handle(Mount(client="n0", segment="n0/dram", size=dram)) == m.Ok()
    return core, clock


def put(core: MasterCore, key: str, **kw: object) -> m.Message:
    r = core.handle(m.PutStart(client="c", item=m.PutItem(key=key, size=KiB, **kw)))
    if isinstance(r, m.PutTargets):
        return core.handle(m.PutEnd(client="c", key=key))
    return r


def read(core: MasterCore, key: str) -> int:
    r = core.handle(m.GetReplicas(key=key))
    assert isinstance(r, m.ReplicaList) and r.lease_id, r
    return r.lease_id


def release(core: MasterCore, key: str, lid: int) -> None:
    assert core.handle(m.ReleaseLeases(keys=[key], ids=[lid])) is None  # one-way: no reply


def test_a_released_lease_ends_at_once() -> None:
    core, _ = make()
    put(core, "k")
    lid = read(core, "k")
    assert core.handle(m.Remove(key="k")).code == C.LEASED  # a read is in flight
    release(core, "k", lid)
    assert core.handle(m.Remove(key="k")) == m.Ok()


def test_a_lease_ends_when_its_last_reader_releases_it() -> None:
    core, _ = make()
    put(core, "k")
    a, b = read(core, "k"), read(core, "k")
    assert a == b  # readers of a running lease share it
    release(core, "k", a)
    assert core.handle(m.Remove(key="k")).code == C.LEASED  # b still copies
    release(core, "k", b)
    assert core.handle(m.Remove(key="k")) == m.Ok()


def test_a_release_of_an_expired_lease_cannot_end_a_newer_one() -> None:
    core, clock = make()
    put(core, "k")
    old = read(core, "k")
    clock.advance_to(106.0)  # its reader was too slow: the lease ran out
    new = read(core, "k")
    assert new != old
    release(core, "k", old)
    assert core.handle(m.Remove(key="k")).code == C.LEASED
    release(core, "k", new)
    assert core.handle(m.Remove(key="k")) == m.Ok()


def test_put_then_get_on_a_full_cache_never_runs_out_of_space() -> None:
    core, _ = make(dram=8 * KiB)
    for i in range(40):  # 8 slots: from the 9th put on, each needs an eviction
        assert put(core, f"k{i}") == m.Ok(), i
        release(core, f"k{i}", read(core, f"k{i}"))
    assert core.counters["no_space"] == 0 and core.counters["evictions"] == 32


def test_remove_prefix_reports_the_keys_it_kept() -> None:
    core, _ = make()
    for k in ("p/a", "p/b", "p/c", "q/d"):
        put(core, k, hard_pin=k == "p/c")
    read(core, "p/b")
    assert core.handle(m.RemovePrefix(prefix="p/")) == m.Removed(
        n=1, kept=2, leased=["p/b"], pinned=["p/c"])
    assert core.handle(m.RemoveAll(force=True)) == m.Removed(n=3)


def test_a_new_leader_s_conservative_lease_is_kept_as_a_floor() -> None:

    core, clock = make()
    put(core, "k")
    core.replication.take_over()  # every value leased for lease_ttl_s (readers of the old one)
    release(core, "k", read(core, "k"))
    assert core.handle(m.Remove(key="k")).code == C.LEASED
    clock.advance_to(105.1)
    assert core.handle(m.Remove(key="k")) == m.Ok()


def test_an_expiry_set_without_a_reader_is_a_floor_for_the_open_lease() -> None:

    core, clock = make()
    put(core, "k")
    lid = read(core, "k")
    clock.advance_to(102.0)
    core.leases.grant("k", core.objs["k"], readers=0)  # e.g. a promotion nobody waits for
    release(core, "k", lid)
    assert core.handle(m.Remove(key="k")).code == C.LEASED
    clock.advance_to(107.1)
    assert core.handle(m.Remove(key="k")) == m.Ok()


# ---------------------------------------------------------------------------- real processes
@pytest.mark.slow
def test_put_then_get_on_a_full_node_and_removes_after_reads() -> None:
    from store_procs import store_cluster

    from yuebing.store.client.client import StoreClient
    from yuebing.store.config import ClientConfig

    leases = ("--lease-ttl-s", "5", "--room-wait-s", "0")
    with store_cluster("leases", master_args=leases) as (mst, _):
        addr = mst.info["address"]
        with StoreClient(ClientConfig(master=addr, reserve_ahead=False)) as c:
            size = 256 * KiB
            for i in range(200):  # 64 values fill the node; the rest need evictions
                value = bytes([i % 251]) * size
                c.put(f"kv/{i}", value)
                assert c.get(f"kv/{i}") == value
            s = c.stats()
            assert s["no_space"] == 0 and s["evictions"] >= 136
            c.get("kv/199")
            c.remove("kv/199")  # read and finished: not LEASED
            assert not c.exists("kv/199")
            with StoreClient(ClientConfig(master=addr)) as other:
                c.get("kv/198")  # then c stays idle: its heartbeat thread sends the release
                time.sleep(1.0)  # (within ~0.1 s; the lease would last 5 s)
                other.remove("kv/198")
            assert c.remove_prefix("kv/").kept == 0
