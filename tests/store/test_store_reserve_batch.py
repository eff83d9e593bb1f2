"""Batch reservations of the master core (one-RPC batch puts): a client holds a list per shape,
`BatchPutCommit` commits each item into its reservation with a code per item, retries leak
nothing, the caps hold, and standbys hold the same lists (virtual clock, no sockets)."""

from __future__ import annotations

from master_factories import durable, exists, leader_and_standby, make, put, ship

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount
from yuebing.store.master import reservations, reserve
from yuebing.store.master.core import MasterCore

C = m.Code
KiB = 1024
SIZE = 4 * KiB


def items(*keys: str, size: int = SIZE, **kw) -> list[m.PutItem]:
    return [m.PutItem(key=k, size=size, **kw) for k in keys]


def start(core: MasterCore, keys: list[str], n: int, client: str = "c",
          size: int = SIZE) -> m.BatchPutTargets:
    t = core.handle(m.BatchPutStart(client=client, items=items(*keys, size=size), reserve_next=n))
    assert isinstance(t, m.BatchPutTargets), t
    return t


def bcommit(core: MasterCore, resv: list[str], keys: list[str], n: int = 0,
            client: str = "c", **kw) -> m.Message:
    return core.handle(m.BatchPutCommit(client=client, reservations=resv,
                                        items=items(*keys, **kw), reserve_next=n))


def test_a_batch_reserves_the_next_batch_and_commits_it_with_one_call() -> None:
    core, _ = make(dram=256 * KiB)
    t = start(core, ["a0", "a1", "a2"], 3)
    assert t.codes == [0, 0, 0] and len(t.reservations) == 3
    names = [r.key for r in t.reservations]
    assert len(set(names)) == 3 and all(n.startswith(m.RESERVED_PREFIX) for n in names)
    offs = {r.replicas[0].offset for r in t.reservations} | {r[0].offset for r in t.replicas}
    assert len(offs) == 6  # six distinct ranges
    core.handle(m.BatchPutEnd(client="c", keys=["a0", "a1", "a2"]))
    done = bcommit(core, names, ["b0", "b1", "b2"], n=3, checksum=5)
    assert isinstance(done, m.BatchPutCommitted) and done.codes == [0, 0, 0]
    assert exists(core, "b0", "b1", "b2") == [True] * 3
    assert not any(n in core.objs for n in names)  # consumed (renamed)
    got = core.handle(m.GetReplicas(key="b1"))
    assert isinstance(got, m.ReplicaList) and got.checksum == 5
    assert got.replicas == t.reservations[1].replicas  # item i went into reservation i
    nxt = [r.key for r in done.reservations]
    assert len(nxt) == 3 and not set(nxt) & set(names)
    assert core.reservations.held("c", reservations.shape_of(items("x")[0])) == nxt
    assert core.counters["reservations_committed"] == 3
    assert core.stats().values["reservations"] == 3


def test_retries_leak_nothing_and_answer_the_same() -> None:
    core, _ = make(dram=256 * KiB)
    t = start(core, ["a0", "a1"], 2)
    again = start(core, ["a0", "a1"], 2)  # retried after a lost reply: same targets, same ones
    assert again.replicas == t.replicas and again.reservations == t.reservations
    core.handle(m.BatchPutEnd(client="c", keys=["a0", "a1"]))
    names = [r.key for r in t.reservations]
    first = bcommit(core, names, ["b0", "b1"], n=2)
    retry = bcommit(core, names, ["b0", "b1"], n=2)  # its first try committed (reply lost)
    assert isinstance(first, m.BatchPutCommitted) and first == retry
    assert core.stats().values["reservations"] == 2 and core.counters["puts"] == 4
    # a batch asking for fewer gets the oldest it holds
    fewer = start(core, ["c0"], 1)
    assert [r.key for r in fewer.reservations] == [first.reservations[0].key]


def test_a_refused_item_fails_alone_and_keeps_its_reservation() -> None:
    core, _ = make(dram=256 * KiB)
    put(core, "taken")
    t = start(core, ["a0", "a1", "a2"], 3)
    core.handle(m.BatchPutEnd(client="c", keys=["a0", "a1", "a2"]))
    names = [r.key for r in t.reservations]
    bogus = m.RESERVED_PREFIX + "c/999999"
    done = bcommit(core, [names[0], names[1], bogus], ["x", "taken", "y"], n=3)
    assert isinstance(done, m.BatchPutCommitted)
    assert done.codes == [int(C.OK), int(C.EXISTS), int(C.NOT_PENDING)]
    assert exists(core, "x", "y") == [True, False]
    # names[1] (refused: key exists) and names[2] (unused) are still held and come back first
    assert [r.key for r in done.reservations][:2] == [names[1], names[2]]
    assert len(done.reservations) == 3
    bad = bcommit(core, names[1:], ["z"])
    assert isinstance(bad, m.Err) and bad.code == C.BAD_REQUEST and "2 reservations" in bad.message


def test_mixed_shapes_get_none_and_the_caps_hold() -> None:
    core, _ = make(dram=4096 * KiB)
    mixed = core.handle(m.BatchPutStart(client="c", items=[
        m.PutItem(key="m0", size=SIZE), m.PutItem(key="m1", size=2 * SIZE)], reserve_next=2))
    assert isinstance(mixed, m.BatchPutTargets) and mixed.reservations == []
    big = start(core, ["b0"], 1000)
    assert len(big.reservations) == reserve.MAX_PER_CLIENT  # asked for more than the cap
    # another shape over the cap in all gets none; none of the first shape's is dropped
    other = start(core, ["o0"], 4, size=2 * SIZE)
    assert other.reservations == []
    first = [r.key for r in big.reservations]
    assert all(k in core.objs for k in first) and len(core.fence.quarantine) == 0
    # given back unused (freed at once, not fenced), they make room for other shapes
    codes = core.handle(m.BatchPutRevoke(client="c", keys=[], unused=first[:60] + ["nope"]))
    assert codes.codes == [0] * 60 + [C.NOT_PENDING]
    assert core.reservations.count("c") == 4 and len(core.fence.quarantine) == 0
    for i in range(3, 3 + reserve.MAX_SHAPES):  # new shapes: 3 more within the cap, then none
        got = start(core, [f"s{i}"], 1, size=i * SIZE).reservations
        assert len(got) == (1 if i < 3 + reserve.MAX_SHAPES - 1 else 0)
    assert len(core.reservations.by_client["c"]) == reserve.MAX_SHAPES
    assert reservations.shape_of(items("x")[0]) in core.reservations.by_client["c"]


def test_standbys_hold_the_same_lists_and_commit_after_take_over() -> None:
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=256 * KiB))
    t = start(leader, ["a0", "a1"], 2, size=KiB)
    leader.handle(m.BatchPutEnd(client="c", keys=["a0", "a1"]))
    hub.publish()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)  # type: ignore[attr-defined]
    shape = reservations.shape_of(items("x", size=KiB)[0])
    names = [r.key for r in t.reservations]
    assert standby.reservations.held("c", shape) == names
    done = bcommit(leader, names, ["b0", "b1"], n=2, size=KiB)
    assert isinstance(done, m.BatchPutCommitted) and done.codes == [0, 0]
    ship(hub, standby)
    assert durable(standby) == durable(leader)
    assert standby.reservations.held("c", shape) == [r.key for r in done.reservations]
    standby.replication.take_over()  # the client's reservations commit on the new leader
    after = bcommit(standby, [r.key for r in done.reservations], ["c0", "c1"], n=2, size=KiB)
    assert isinstance(after, m.BatchPutCommitted) and after.codes == [0, 0]
    retry = bcommit(standby, names, ["b0", "b1"], size=KiB)  # a retry reaching the new leader
    assert isinstance(retry, m.BatchPutCommitted) and retry.codes == [0, 0]


def test_the_client_holds_what_the_master_holds_across_shapes() -> None:
    """Two shapes whose batches together exceed the master's cap per client: the master drops
    the other shape's oldest to make room, and the client must forget the same ones — else its
    next batch writes into reservations the master dropped and every such item is refused."""
    from yuebing.store.client.reserve import HeldReservations
    from yuebing.store.client.reserve import shape_of as client_shape
    core, _ = make(dram=4096 * KiB)
    h = HeldReservations()
    n = 40
    shapes = {s: client_shape(items("x", size=s)[0]) for s in (SIZE, 2 * SIZE)}
    for rnd in range(3):
        for size, shape in shapes.items():
            keys = [f"{rnd}-{size}-{i}" for i in range(n)]
            held, stale = h.take_many(shape, n, 0.0)
            assert not stale
            if held:
                done = bcommit(core, [x.key for x in held], keys, n=n, size=size)
                assert isinstance(done, m.BatchPutCommitted), done
                assert done.codes == [0] * n  # nothing written into a dropped reservation
                h.keep_many(shape, done.reservations, 0.0)
            else:
                t = start(core, keys, n, size=size)
                core.handle(m.BatchPutEnd(client="c", keys=keys))
                h.keep_many(shape, t.reservations, 0.0)
            mine = {x.key for hs in h.held.values() for x in hs}
            assert mine == set(core.reservations.by_key)
            assert len(mine) <= reserve.MAX_PER_CLIENT


def test_malformed_batch_commits_are_refused_precisely_and_change_nothing() -> None:
    core, _ = make(dram=256 * KiB)
    names = [r.key for r in start(core, ["a0", "a1"], 2).reservations]
    core.handle(m.BatchPutEnd(client="c", keys=["a0", "a1"]))
    for bad, why in ((bcommit(core, [], [], n=2), "at least one item"),
                     (bcommit(core, names, ["b0", "b1"], n=-1), "reserve_next"),
                     (core.handle(m.BatchPutStart(client="c", items=items("d0"), reserve_next=-3)),
                      "reserve_next"),
                     (core.handle(m.BatchPutStart(client="c", items=[], reserve_next=2)),
                      "at least one item"),
                     (core.handle(m.BatchPutStart(client="c", items=[])), "at least one item"),
                     (bcommit(core, names[:1], ["b0", "b1"]), "1 reservations for 2 items")):
        assert isinstance(bad, m.Err) and bad.code == C.BAD_REQUEST and why in bad.message, bad
    assert exists(core, "b0", "b1", "d0") == [False] * 3
    assert sorted(core.reservations.by_key) == sorted(names)
