"""Values the master holds itself (`PutInline`, `store/master/inline.py`) in the core: one
request commits them, gets answer them in the reply, they share ``inline_capacity`` in LRU
order with pins honoured, removal and events treat them as any value, a resent put answers
OK only for its own client, and they survive replication, snapshots and a takeover."""

from __future__ import annotations

import pytest
from master_factories import KiB, leader_and_standby, make, ship

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind
from yuebing.store.master.objects import HELD_OVERHEAD

C = m.Code
H = m.INLINE_HOLDER


def inline(core, key: str, value: bytes, client: str = "c", **kw) -> m.Message:
    return core.handle(m.PutInline(client=client, item=m.PutItem(key=key, size=len(value), **kw),
                                   value=value))


def code(reply: m.Message) -> int:
    if isinstance(reply, m.InlineRefused):
        return C.NOT_INLINE
    return reply.code if isinstance(reply, m.Err) else 0


def test_put_is_one_request_and_get_answers_the_value_without_a_lease() -> None:
    core, _ = make()
    assert inline(core, "k", b"v" * 4000, checksum=7) == m.Ok()
    assert core.events == [(EventKind.STORED, "k", [H])]
    assert core.handle(m.Exists(key="k")) == m.Bools(values=[True])
    r = core.handle(m.GetReplicas(key="k"))
    assert r == m.ReplicaList(key="k", size=4000, checksum=7, replicas=[], lease_s=0.0,
                              value=b"v" * 4000)
    assert core.leases.open == {} and core.objs["k"].lease == 0.0
    s = core.stats().values
    assert (s["inline_objects"], s["puts"], s["gets"]) == (1, 1, 1)
    assert s["inline_used"] == 4000 + HELD_OVERHEAD  # its metadata counts too
    assert s["dram_used"] == 0  # no segment byte is involved
    r = core.handle(m.BatchGetReplicas(keys=["nope", "k"]))
    assert r.codes == [C.NOT_FOUND, C.OK] and r.values == [None, b"v" * 4000]


def test_resent_put_answers_ok_for_its_client_only_and_keys_stay_immutable() -> None:
    core, _ = make()
    assert inline(core, "k", b"a" * 100) == m.Ok()
    assert inline(core, "k", b"a" * 100) == m.Ok()  # the reply was lost: same client, bytes
    assert code(inline(core, "k", b"b" * 100)) == C.EXISTS
    assert code(inline(core, "k", b"a" * 100, client="other")) == C.EXISTS
    r = core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=100)))
    assert code(r) == C.EXISTS
    assert core.stats().values["puts"] == 1


def test_what_the_master_will_not_hold_goes_the_normal_way() -> None:
    core, _ = make(inline_max_bytes=2 * KiB)
    big = inline(core, "big", b"x" * (2 * KiB + 1))
    assert big == m.InlineRefused(max_bytes=2 * KiB, message=big.message)  # smaller ones: ask
    assert code(inline(core, "two", b"x", replicas=2)) == C.NOT_INLINE
    assert code(inline(core, "placed", b"x", strategy="random")) == C.NOT_INLINE
    assert inline(core, "best", b"x", replicas=2, min_replicas=1) == m.Ok()
    assert code(inline(core, m.RESERVED_PREFIX + "k", b"x")) == C.BAD_REQUEST
    bad = core.handle(m.PutInline(client="c", item=m.PutItem(key="k", size=5), value=b"abc"))
    assert code(bad) == C.BAD_REQUEST and "3 bytes" in bad.message
    assert not core.handle(m.Exists(key="big")).values[0]
    off, _ = make(inline_max_bytes=0)
    assert inline(off, "k", b"x").max_bytes == 0  # none: the client stops asking a while


def test_capacity_evicts_least_recently_read_and_never_a_pinned_value() -> None:
    each = KiB + HELD_OVERHEAD
    core, clock = make(inline_max_bytes=KiB, inline_capacity=3 * each)
    for k in ("a", "b", "c"):
        assert inline(core, k, b"x" * KiB) == m.Ok()
    core.handle(m.GetReplicas(key="a"))  # b is now the least recently read
    core.events.clear()
    assert inline(core, "d", b"x" * KiB) == m.Ok()
    assert sorted(core.objects.inline) == ["a", "c", "d"]
    assert core.events == [(EventKind.REMOVED, "b", [H]), (EventKind.STORED, "d", [H])]
    core.handle(m.Pin(keys=["c"], soft_pin_s=60.0))  # soft: evicted only after the others
    assert inline(core, "e", b"x" * KiB) == m.Ok()
    assert sorted(core.objects.inline) == ["c", "d", "e"]  # a went, not c
    core.handle(m.Pin(keys=["d", "e"], hard=True))
    assert inline(core, "f", b"x" * KiB) == m.Ok()  # the soft pin gives way last
    assert sorted(core.objects.inline) == ["d", "e", "f"]
    core.handle(m.Pin(keys=["f"], hard=True))
    full = inline(core, "g", b"x" * 10)  # all hard-pinned: refused, even a small one
    assert isinstance(full, m.InlineRefused) and full.max_bytes == 0
    s = core.stats().values
    assert (s["inline_used"], s["inline_refused"], s["evictions"]) == (3 * each, 1, 3)


def test_removal_and_batches_treat_held_values_as_any_value() -> None:
    core, _ = make()
    r = core.handle(m.BatchPutInline(client="c", items=[
        m.PutItem(key=f"p/{i}", size=10) for i in range(3)] + [m.PutItem(key="q", size=10)],
        values=[bytes([i]) * 10 for i in range(4)]))
    assert r == m.InlineCodes(codes=[0, 0, 0, 0], max_bytes=16 * KiB)
    mixed = core.handle(m.BatchPutInline(client="c", items=[m.PutItem(key="q", size=10),
                                                            m.PutItem(key="r", size=1)],
                                         values=[b"z" * 10]))
    assert code(mixed) == C.BAD_REQUEST
    core.events.clear()
    assert core.handle(m.Remove(key="q")) == m.Ok()
    assert core.handle(m.RemovePrefix(prefix="p/")).n == 3
    assert sorted(k for _, k, h in core.events if h == [H]) == ["p/0", "p/1", "p/2", "q"]
    assert all(kind == EventKind.REMOVED for kind, *_ in core.events)
    assert core.objects.inline == {} and core.objects.inline_bytes == 0
    assert core.objs == {}


def test_held_values_survive_entries_snapshot_and_takeover() -> None:
    leader, standby, hub = leader_and_standby()
    assert inline(leader, "before", b"b" * 300, soft_pin_s=30.0) == m.Ok()
    hub.publish()  # entries before the subscription are inside the snapshot
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert inline(leader, "after", b"a" * 200, hard_pin=True) == m.Ok()
    assert inline(leader, "gone", b"g" * 10) == m.Ok()
    leader.handle(m.Remove(key="gone"))
    ship(hub, standby)
    assert standby.objects.inline == {"before": b"b" * 300, "after": b"a" * 200}
    assert standby.objects.inline_bytes == 500 + 2 * HELD_OVERHEAD
    second = leader_and_standby()[1]  # a standby that joins now gets both in its snapshot
    second.replication.load_snapshot(leader.replication.snapshot())
    assert second.objects.inline == standby.objects.inline
    standby.replication.take_over()
    r = standby.handle(m.GetReplicas(key="after"))
    assert r.value == b"a" * 200 and standby.objs["after"].pin
    assert standby.objs["before"].soft > standby.clock.now()
    assert standby.handle(m.PutInline(client="c", item=m.PutItem(key="after", size=200),
                                      value=b"a" * 200)) == m.Ok()  # resent across failover
    assert standby.handle(m.Remove(key="before")) == m.Ok()  # no blanket lease: no reader
    assert standby.log[-1] == ["del", "before"]


def test_a_capacity_that_cannot_hold_one_largest_value_is_refused() -> None:
    from yuebing.core.errors import ConfigError
    from yuebing.store.config import MasterConfig
    with pytest.raises(ConfigError, match=r"--inline-capacity must be in 16896 \(--inline-max"):
        MasterConfig(inline_max_bytes=16 << 10, inline_capacity=16 << 10)
    MasterConfig(inline_max_bytes=0, inline_capacity=0)  # off: no budget needed
