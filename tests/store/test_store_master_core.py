"""Master core rules with exact expectations (no sockets, virtual clock)."""

from __future__ import annotations

import pytest
from master_factories import KiB, exists, make, put

from yuebing.core.config import replace
from yuebing.core.errors import ConfigError
from yuebing.protocol import store as m
from yuebing.protocol.codec import decode, encode
from yuebing.protocol.store_cluster import Drain, EventKind, Mount, TaskDone, Unmount
from yuebing.store.config import ClientConfig, MasterConfig
from yuebing.store.master.allocator import OffsetAllocator

C = m.Code


def test_allocator_best_fit_coalesce_and_rebuild() -> None:
    a = OffsetAllocator(10 * 1024, alignment=1024)
    offs = [a.alloc(1024) for _ in range(10)]
    assert offs == [i * 1024 for i in range(10)] and a.alloc(1) is None
    a.free_range(1024, 1000)
    a.free_range(2048, 1024)
    a.free_range(5 * 1024, 1)
    assert a.alloc(2048) == 1024  # coalesced hole of 2 KiB, best fit
    assert a.alloc(1024) == 5 * 1024
    assert a.used == 10 * 1024
    b = OffsetAllocator.rebuild(10 * 1024, 1024, [(0, 1024), (4096, 2048)])
    assert b.used == 3072 and b.alloc(3 * 1024) == 1024 and b.alloc(4 * 1024) == 6 * 1024
    assert b.reserve(1024, 10) is False


def test_two_phase_put_visibility() -> None:
    core, _ = make()
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=5000, checksum=7)))
    assert t == m.PutTargets(key="k", replicas=[m.Replica(segment="n0/dram", offset=0)],
                             expires_in_s=30.0)  # put_timeout_s: the client asked for no less
    assert exists(core, "k") == [False]
    assert core.handle(m.GetReplicas(key="k")).code == C.NOT_FOUND
    assert core.handle(m.PutEnd(client="other", key="k")).code == C.NOT_PENDING
    assert core.handle(m.PutEnd(client="c", key="k")) == m.Ok()
    assert exists(core, "k") == [True]
    r = core.handle(m.GetReplicas(key="k"))
    assert r == m.ReplicaList(
        key="k", size=5000, checksum=7, replicas=[m.Replica(segment="n0/dram", offset=0)],
        lease_s=5.0, lease_id=r.lease_id) and r.lease_id
    assert core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=1))).code == C.EXISTS
    t2 = core.handle(m.PutStart(client="c", item=m.PutItem(key="p", size=100)))
    assert core.handle(m.PutStart(client="c", item=m.PutItem(key="p", size=100))) == t2  # retry
    assert core.handle(m.PutStart(client="d", item=m.PutItem(key="p", size=100))).code == C.EXISTS
    assert core.handle(m.PutEnd(client="c", key="k")) == m.Ok()  # a retry: committed already
    assert core.handle(m.PutEnd(client="d", key="k")).code == C.NOT_PENDING
    assert core.events == [(EventKind.STORED, "k", ["n0/dram"])]


def test_revoke_frees_space_and_bad_items_change_nothing() -> None:
    core, clock = make(dram=8 * KiB)
    core.handle(m.PutStart(client="c", item=m.PutItem(key="a", size=8 * KiB, timeout_s=1.0)))
    assert core.handle(m.PutRevoke(client="c", key="a")) == m.Ok()
    assert core.stats().values["dram_used"] == 8 * KiB  # quarantined until the write fence
    clock.advance_to(104.01)  # expiry 1 s + write grace 1 s + fence 2 s
    core.tick()
    assert core.stats().values["dram_used"] == 0
    r = core.handle(m.BatchPutStart(client="c", items=[
        m.PutItem(key="", size=1), m.PutItem(key="x", size=0),
        m.PutItem(key="y", size=1, strategy="nope"), m.PutItem(key="z", size=1, replicas=0)]))
    assert r.codes == [C.BAD_REQUEST] * 4 and core.objs == {}


def test_replicas_on_distinct_segments_and_preferred() -> None:
    core, _ = make(segs=3)
    r = core.handle(m.PutStart(client="c", item=m.PutItem(
        key="k", size=KiB, replicas=3, strategy="preferred", preferred=["n2/dram"])))
    names = [x.segment for x in r.replicas]
    assert names[0] == "n2/dram" and sorted(names) == ["n0/dram", "n1/dram", "n2/dram"]
    r = core.handle(m.PutStart(client="c", item=m.PutItem(key="k2", size=KiB, replicas=5,
                                                           min_replicas=1)))
    assert len({x.segment for x in r.replicas}) == 3  # best effort: only 3 segments exist


def test_free_ratio_spreads_and_local_first() -> None:
    core, _ = make(segs=2)
    segs = [core.handle(m.PutStart(client="c", item=m.PutItem(key=f"k{i}", size=KiB))
                        ).replicas[0].segment for i in range(4)]
    assert sorted(segs) == ["n0/dram", "n0/dram", "n1/dram", "n1/dram"]
    r = core.handle(m.PutStart(client="n1", item=m.PutItem(key="l", size=KiB,
                                                            strategy="local_first")))
    assert r.replicas[0].segment == "n1/dram"


def test_lease_blocks_remove_until_expiry_and_force() -> None:
    core, clock = make(lease_ttl_s=5.0)
    put(core, "k")
    core.handle(m.GetReplicas(key="k"))
    assert core.handle(m.Remove(key="k")).code == C.LEASED
    clock.advance_to(104.0)
    assert core.handle(m.Remove(key="k")).code == C.LEASED
    clock.advance_to(105.01)
    assert core.handle(m.Remove(key="k")) == m.Ok()
    put(core, "j")
    core.handle(m.GetReplicas(key="j"))
    assert core.handle(m.Remove(key="j", force=True)) == m.Ok()
    assert exists(core, "k", "j") == [False, False]


def test_probe_never_leases_and_lease_does_not_pin_forever() -> None:
    core, clock = make(dram=8 * KiB)
    put(core, "a")
    put(core, "b")
    for _ in range(100):  # probes grant nothing
        assert exists(core, "a") == [True]
        core.handle(m.PrefixMatch(keys=["a"]))
    assert core.objs["a"].lease == 0.0
    core.handle(m.GetReplicas(key="a"))
    assert put(core, "c") == m.Ok()  # b (never read) is the LRU victim; a is leased anyway
    assert exists(core, "a", "b", "c") == [True, False, True]
    core.handle(m.GetReplicas(key="c"))
    clock.advance_to(106.0)  # a's lease expired, c's too: probes kept neither alive
    assert put(core, "d") == m.Ok()
    assert exists(core, "a", "c", "d") == [False, True, True]


def test_eviction_order_pins_and_soft_pins() -> None:
    core, clock = make(dram=8 * KiB)  # room for two 4 KiB values
    put(core, "hard", hard_pin=True)
    put(core, "soft", soft_pin_s=30.0)
    assert put(core, "x") == m.Ok()  # evicts soft (second pass): hard never goes
    assert exists(core, "hard", "soft", "x") == [True, False, True]
    core.handle(m.GetReplicas(key="x"))  # leased now
    r = put(core, "y")
    assert r.code == C.NO_SPACE and exists(core, "hard", "x", "y") == [True, True, False]
    assert core.handle(m.Remove(key="hard")).code == C.PINNED
    core.handle(m.Pin(keys=["hard"], unpin=True))
    clock.advance_to(200.0)
    assert put(core, "y") == m.Ok()
    assert exists(core, "hard", "x", "y") == [False, True, True]  # LRU: hard older than x


def test_watermark_eviction_follows_lru_order() -> None:
    core, clock = make(dram=10 * KiB, high_watermark=0.8, evict_ratio=0.3, lease_ttl_s=1.0)
    for i in range(8):
        put(core, f"k{i}", size=KiB)
    core.handle(m.GetReplicas(key="k0"))
    core.handle(m.GetReplicas(key="k1"))
    clock.advance_to(102.0)
    core.tick()  # 8/10 used: not above 0.8
    assert len(core.objs) == 8
    put(core, "k8", size=KiB)
    core.tick()  # 9/10 > 0.8: evict down to 0.5 -> 4 objects go, least recently read first
    assert sorted(core.objs) == ["k0", "k1", "k6", "k7", "k8"]
    assert [e[1] for e in core.events if e[0] == EventKind.REMOVED] == ["k2", "k3", "k4", "k5"]


def test_prefix_match_and_remove_forms() -> None:
    core, _ = make()
    for k in ("p/1", "p/2", "p/3", "q/1"):
        put(core, k, size=KiB)
    assert core.handle(m.PrefixMatch(keys=["p/1", "p/2", "p/9", "p/3"])) == m.Count(n=2)
    assert core.handle(m.PrefixMatch(keys=[])) == m.Count(n=0)
    assert core.handle(m.BatchRemove(keys=["p/1", "nope"])).codes == [C.OK, C.NOT_FOUND]
    assert core.handle(m.RemovePrefix(prefix="p/")) == m.Removed(n=2)
    assert core.handle(m.RemoveAll()) == m.Removed(n=1)
    assert core.stats().values["dram_used"] == 0


def test_session_expiry_drops_segments_and_pending_puts() -> None:
    core, clock = make(segs=2, client_ttl_s=10.0)
    r = core.handle(m.PutStart(client="c", item=m.PutItem(key="both", size=KiB, replicas=2)))
    assert len(r.replicas) == 2
    core.handle(m.PutEnd(client="c", key="both"))
    core.handle(m.PutStart(client="c", item=m.PutItem(key="only0", size=KiB,
                                                       strategy="preferred", preferred=["n0/dram"])))
    core.handle(m.PutEnd(client="c", key="only0"))
    core.handle(m.PutStart(client="w", item=m.PutItem(key="half", size=KiB)))
    clock.advance_to(105.0)
    core.handle(m.Heartbeat(client="n1"))
    core.handle(m.Heartbeat(client="c"))
    clock.advance_to(111.0)
    core.tick()  # n0 and w are dead
    assert sorted(core.sessions.sessions) == ["c", "n1"]
    assert exists(core, "both", "only0", "half") == [True, False, False]
    removed = sorted((e[1], e[2]) for e in core.events if e[0] == EventKind.REMOVED)
    assert removed == [("both", ["n0/dram"]), ("only0", ["n0/dram"])]
    assert core.handle(m.GetReplicas(key="both")).replicas == [m.Replica(segment="n1/dram",
                                                                         offset=0)]


def test_node_lost_mid_put_leaves_nothing_readable() -> None:
    core, _ = make()
    core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=KiB)))
    core.handle(Unmount(client="n0", segment="n0/dram"))
    assert core.handle(m.PutEnd(client="c", key="k")).code == C.NOT_FOUND
    assert exists(core, "k") == [False] and core.objs == {}


def test_zombie_put_reclaimed() -> None:
    core, clock = make(put_timeout_s=3.0)
    core.handle(m.PutStart(client="c", item=m.PutItem(key="z", size=KiB)))
    clock.advance_to(103.5)
    core.handle(m.Heartbeat(client="c"))
    core.tick()
    assert core.objs == {} and core.counters["zombies"] == 1
    assert core.handle(m.PutEnd(client="c", key="z")).code == C.NOT_PENDING


def test_offload_to_ssd_then_promotion_on_hit() -> None:
    core, clock = make(dram=8 * KiB, ssd=64 * KiB, high_watermark=0.6, evict_ratio=0.1)
    put(core, "a")
    put(core, "b")
    core.tick()  # 8/8 > 0.6 -> offload the LRU one ("a") until <= 0.5
    assert len(core.outbox) == 1
    owner, task = core.outbox.pop()
    assert (owner, task.src_segment, task.dst_segment, task.size) == ("n0", "n0/dram", "n0/ssd",
                                                                      4 * KiB)
    assert exists(core, "a") == [True]  # still readable while the copy runs
    core.handle(TaskDone(client="n0", task=task.task, ok=True))
    assert [core.segs[s].tier for s, _ in core.objs["a"].reps] == [1]
    assert core.stats().values["dram_used"] == 4 * KiB and exists(core, "a") == [True]
    assert core.events[-2:] == [(EventKind.STORED, "a", ["n0/ssd"]),
                                (EventKind.REMOVED, "a", ["n0/dram"])]
    assert core.handle(m.GetReplicas(key="a"), waiter="w1") is None  # deferred: promoting
    assert core.handle(m.GetReplicas(key="a"), waiter="w2") is None  # joins the same task
    (owner, ptask), = core.outbox
    assert (ptask.src_segment, ptask.dst_segment) == ("n0/ssd", "n0/dram")
    core.handle(TaskDone(client="n0", task=ptask.task, ok=True))
    lid = core.ready[0][1].lease_id  # type: ignore[attr-defined]
    reply = m.ReplicaList(key="a", size=4 * KiB, checksum=-1,
                          replicas=[m.Replica(segment="n0/dram", offset=ptask.dst_offset)],
                          lease_s=core.cfg.lease_ttl_s, lease_id=lid)  # waiters get a lease too
    assert core.ready == [("w1", reply), ("w2", reply)] and lid
    assert core.leases.open["a"][0] == 2  # both readers count until they release it


def test_replica_replies_carry_the_read_lease() -> None:
    """A reader learns how long its lease runs (`lease_s`, seconds from the reply) so it can
    stop reading before the space may be reused; single and batch replies alike."""
    core, clock = make(lease_ttl_s=2.5)
    assert put(core, "a") == m.Ok()
    r = core.handle(m.GetReplicas(key="a"))
    assert isinstance(r, m.ReplicaList) and r.lease_s == 2.5
    assert core.objs["a"].lease == clock.now() + 2.5
    b = core.handle(m.BatchGetReplicas(keys=["a", "missing"]))
    assert isinstance(b, m.BatchReplicaList) and b.lease_s == 2.5
    assert b.codes == [0, C.NOT_FOUND]
    assert decode(encode(b)) == b and decode(encode(r)) == r  # on the wire too


def test_bad_requests_rejected() -> None:
    core, _ = make()
    assert core.handle(m.Ok()).code == C.BAD_REQUEST
    assert core.handle(Mount(client="x", segment="n0/dram", size=10)).code == C.EXISTS
    assert core.handle(Unmount(client="x", segment="n0/dram")).code == C.BAD_REQUEST
    assert core.handle(Unmount(client="x", segment="zz")).code == C.UNKNOWN_SEGMENT
    with pytest.raises(ConfigError, match="high-watermark"):
        replace(MasterConfig(), high_watermark=1.5)


def test_offload_of_a_value_read_meanwhile_keeps_dram_until_lease_ends() -> None:
    core, clock = make(dram=8 * KiB, ssd=64 * KiB, high_watermark=0.6, evict_ratio=0.1)
    put(core, "a")
    put(core, "b")
    core.tick()
    (_, task), = core.outbox
    core.outbox.clear()
    assert core.handle(m.GetReplicas(key="a")).replicas == [m.Replica(segment="n0/dram", offset=0)]
    core.handle(TaskDone(client="n0", task=task.task, ok=True))
    assert [core.segs[s].tier for s, _ in core.objs["a"].reps] == [0, 1]  # reader still on DRAM
    assert core.stats().values["dram_used"] == 8 * KiB
    clock.advance_to(106.0)  # lease over; "b" is older than the re-read "a" -> offloaded first
    core.tick()
    assert [t.src_offset for _, t in core.outbox] == [4 * KiB]
    assert core.handle(m.Remove(key="a")) == m.Ok()
    usage = core.stats().values  # left: b in DRAM + the SSD range of b's copy in flight
    assert (usage["dram_used"], usage["ssd_used"]) == (4 * KiB, 4 * KiB)


def test_configs_reject_bad_values() -> None:
    from yuebing.store.config import NodeConfig

    with pytest.raises(ConfigError, match="--ssd must be DIR:SIZE"):
        NodeConfig(ssd="/tmp/x")
    with pytest.raises(ConfigError, match="cannot parse size"):
        NodeConfig(ssd="/tmp/x:lots")
    assert NodeConfig(ssd="/tmp/x:1GiB").ssd_dir_size == ("/tmp/x", 1 << 30)
    with pytest.raises(ConfigError, match="--master needs at least one address"):
        ClientConfig(master=" , ")
    with pytest.raises(ConfigError, match="--placement must be one of"):
        MasterConfig(placement="closest")


@pytest.mark.parametrize("field", ["put_timeout_s", "client_ttl_s", "lease_ttl_s", "tick_s",
                                   "repl_timeout_s"])
def test_master_durations_must_be_finite(field: str) -> None:
    with pytest.raises(ConfigError, match="finite number of seconds"):
        MasterConfig(**{field: float("inf")})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["rpc_timeout_s", "heartbeat_s", "transfer_timeout_s"])
def test_client_durations_must_be_finite(field: str) -> None:
    with pytest.raises(ConfigError, match="finite number of seconds"):
        ClientConfig(**{field: float("inf")})  # type: ignore[arg-type]


def test_drain_stops_placement_and_drops_redundant_replicas_once_leases_end() -> None:
    core, clock = make(segs=2, lease_ttl_s=1.0)
    r = core.handle(m.PutStart(client="c", item=m.PutItem(
        key="k", size=KiB, replicas=2, strategy="preferred", preferred=["n0/dram", "n1/dram"])))
    assert [x.segment for x in r.replicas] == ["n0/dram", "n1/dram"]
    core.handle(m.PutEnd(client="c", key="k"))
    core.handle(m.GetReplicas(key="k"))
    assert core.handle(Drain(client="n0", segment="n0/dram")).at_risk == 0  # n1 keeps one
    assert core.outbox == []  # nothing to migrate
    r = core.handle(m.PutStart(client="c", item=m.PutItem(key="j", size=KiB, strategy="preferred",
                                                           preferred=["n0/dram"])))
    assert r.replicas[0].segment == "n1/dram"  # draining segments get no new values
    core.tick()
    assert [core.segs[s].name for s, _ in core.objs["k"].reps] == ["n0/dram", "n1/dram"]  # leased
    clock.advance_to(101.5)
    core.tick()
    assert [core.segs[s].name for s, _ in core.objs["k"].reps] == ["n1/dram"]
    assert core.segs[core.seg_by_name["n0/dram"]].alloc.used == 0


def test_failed_write_suspects_segment_until_its_node_heartbeats() -> None:
    core, _ = make(segs=2)
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=4 * KiB,
                                                         strategy="preferred", preferred=["n1/dram"])))
    assert t.replicas == [m.Replica(segment="n1/dram", offset=0)]
    assert core.handle(m.BatchPutRevoke(client="c", keys=["k"], failed=["n1/dram", "nope"])) \
        == m.Codes(codes=[C.OK])
    assert core.counters["suspects"] == 1 and exists(core, "k") == [False]
    # n1 is preferred but suspected: the retry lands on n0, and so does every other put
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=4 * KiB,
                                                         strategy="preferred", preferred=["n1/dram"])))
    assert t.replicas == [m.Replica(segment="n0/dram", offset=0)]
    assert core.handle(m.PutStart(client="c", item=m.PutItem(key="k2", size=4 * KiB, replicas=2))) \
        .code == C.NO_SPACE  # n1 takes no puts: two copies cannot be placed
    assert core.handle(m.PutStart(client="c", item=m.PutItem(
        key="k2", size=4 * KiB, replicas=2, min_replicas=1))).replicas == [
        m.Replica(segment="n0/dram", offset=4 * KiB)]
    core.handle(m.Heartbeat(client="n1"))  # n1 is alive after all: placement uses it again
    assert put(core, "k3", strategy="preferred", preferred=["n1/dram"]) == m.Ok()
    # offset 0 of n1 is still quarantined (the revoked "k" may yet be written there)
    assert core.objs["k3"].reps == ((core.seg_by_name["n1/dram"], 4 * KiB),)


def test_freeze_long_lived_moves_survivors_out_of_collections() -> None:
    import gc

    from yuebing.store.master.service import freeze_long_lived

    records = [[i] for i in range(1000)]  # tracked containers, as the master's metadata is
    try:
        freeze_long_lived()
        assert gc.get_freeze_count() >= len(records)
        scanned = {id(o) for g in (0, 1, 2) for o in gc.get_objects(generation=g)}
        assert [id(r) in scanned for r in records] == [False] * len(records)
    finally:
        gc.unfreeze()
