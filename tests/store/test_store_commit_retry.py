"""Retried commits are idempotent: the RPC layer re-sends a `PutEnd` / `BatchPutEnd` /
`PutCommit` after a lost reply or a failover; when its first try committed, the same client's
retry answers success (no second STORED event, nothing counted twice), another client's is
still refused, and a standby ends with the committing client as owner (virtual clock, no
sockets)."""

from __future__ import annotations

import msgspec
from master_factories import SIZE, commit, durable, leader_and_standby, make, put, ship, start

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, DrainStatus, EventKind, Mount
from yuebing.store.master import reservations
from yuebing.store.master.core import MasterCore
from yuebing.store.master.state import ObjState

C = m.Code
KiB = 1024


def stored(core: MasterCore) -> list[str]:
    return [k for kind, k, _ in core.events if kind == EventKind.STORED]


def test_repeated_put_end_of_the_same_client_succeeds_once() -> None:
    core, _ = make()
    assert put(core, "k", checksum=5) == m.Ok()
    log_len, counters = len(core.events), dict(core.counters)
    assert core.handle(m.PutEnd(client="c", key="k")) == m.Ok()  # the retry
    assert core.handle(m.BatchPutEnd(client="c", keys=["k", "nope"])) == m.Codes(
        codes=[int(C.OK), int(C.NOT_PENDING)])
    assert len(core.events) == log_len and stored(core) == ["k"]
    assert core.counters == counters and core.counters["puts"] == 1
    o = core.objs["k"]
    assert o.state == ObjState.COMMITTED and o.owner == "c" and "k" not in core.objects.pending


def test_repeated_put_end_of_another_client_is_refused() -> None:
    core, _ = make()
    assert put(core, "k") == m.Ok()
    for msg in (core.handle(m.PutEnd(client="d", key="k")),
                core.handle(m.PutRevoke(client="c", key="k"))):  # a revoke never drops a value
        assert isinstance(msg, m.Err) and msg.code == C.NOT_PENDING, msg
    assert core.handle(m.BatchPutEnd(client="d", keys=["k"])) == m.Codes(codes=[int(C.NOT_PENDING)])
    assert core.counters["puts"] == 1 and stored(core) == ["k"] and "k" in core.objs


def test_owner_string_is_shared_per_client() -> None:
    """A decoded message brings a new client string each time; committed objects share one."""
    core, _ = make()
    for i in range(3):
        client = "".join(["cl", "ient"])  # a distinct str object per put
        core.handle(m.PutStart(client=client, item=m.PutItem(key=f"k{i}", size=KiB)))
        core.handle(m.PutEnd(client=client, key=f"k{i}"))
    owners = [core.objs[f"k{i}"].owner for i in range(3)]
    assert owners == ["client"] * 3 and owners[0] is owners[1] is owners[2]


def test_repeated_put_commit_of_the_same_client_succeeds_with_its_held_reservation() -> None:
    core, _ = make()
    r = start(core, "a").reservation
    assert r is not None and core.handle(m.PutEnd(client="c", key="a")) == m.Ok()
    done = commit(core, r.key, "b", checksum=9)
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    counters, events = dict(core.counters), list(core.events)
    again = commit(core, r.key, "b", checksum=9)  # the retry: the lost reply's reservation
    assert again == done
    assert commit(core, r.key, "b", checksum=9, nxt=False) == m.PutCommitted(reservation=None)
    assert core.counters == counters and core.events == events
    assert stored(core) == ["a", "b"] and core.stats().values["reservations"] == 1
    assert core.counters["puts"] == 2 and core.counters["reservations_committed"] == 1


def test_repeated_put_commit_that_does_not_match_is_refused() -> None:
    core, _ = make()
    r = start(core, "a").reservation
    assert r is not None and core.handle(m.PutEnd(client="c", key="a")) == m.Ok()
    assert isinstance(commit(core, r.key, "b", checksum=9), m.PutCommitted)
    for msg, text in ((commit(core, r.key, "b", client="d", checksum=9), "no reservation"),
                      (commit(core, r.key, "b", checksum=8), "no reservation"),
                      (commit(core, r.key, "b", size=SIZE + 1, checksum=9), "no reservation"),
                      (commit(core, r.key, "a", checksum=4), "no reservation")):
        assert isinstance(msg, m.Err) and msg.code == C.NOT_PENDING and text in msg.message, msg
    assert core.counters["reservations_committed"] == 1 and stored(core) == ["a", "b"]


def test_a_held_reservation_still_refuses_a_second_put_of_a_stored_key() -> None:
    """Only a consumed reservation makes a commit a retry: a new put of a key the client
    already stored, through a live reservation, is still EXISTS."""
    core, _ = make()
    r = start(core, "a").reservation
    assert r is not None and core.handle(m.PutEnd(client="c", key="a")) == m.Ok()
    msg = commit(core, r.key, "a")
    assert isinstance(msg, m.Err) and msg.code == C.EXISTS and r.key in core.objs


def test_standby_keeps_the_owner_and_answers_a_retry_after_take_over() -> None:
    """The first tries commit on the old leader and reach the standby (entries and snapshot);
    their replies are lost; the retries reach the new leader and succeed, once."""
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    for key, client in (("early", "c"), ("other", "d")):
        leader.handle(m.PutStart(client=client, item=m.PutItem(key=key, size=KiB)))
        leader.handle(m.PutEnd(client=client, key=key))
    hub.publish()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert {k: o.owner for k, o in standby.objs.items()} == {"early": "c", "other": "d"}
    t = leader.handle(m.PutStart(client="c", item=m.PutItem(key="a", size=KiB),
                                 reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is not None
    leader.handle(m.PutEnd(client="c", key="a"))
    done = leader.handle(m.PutCommit(client="c", reservation=t.reservation.key, item=m.PutItem(
        key="b", size=KiB, checksum=3), reserve_next=True))
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    ship(hub, standby)
    assert durable(standby) == durable(leader)
    assert {k: o.owner for k, o in standby.objs.items()} == {
        k: o.owner for k, o in leader.objs.items()}
    assert standby.objs["a"].owner == standby.objs["b"].owner == "c"
    standby.replication.take_over()
    assert standby.handle(m.PutEnd(client="c", key="a")) == m.Ok()
    assert standby.handle(m.PutEnd(client="c", key="early")) == m.Ok()
    assert standby.handle(m.PutEnd(client="c", key="other")).code == C.NOT_PENDING  # type: ignore[union-attr]
    again = standby.handle(m.PutCommit(client="c", reservation=t.reservation.key,
                                       item=m.PutItem(key="b", size=KiB, checksum=3),
                                       reserve_next=True))
    assert again == m.PutCommitted(reservation=m.Reservation(
        key=done.reservation.key, replicas=done.reservation.replicas,
        expires_in_s=again.reservation.expires_in_s))  # type: ignore[union-attr]
    assert standby.log == [] and standby.events == [] and standby.counters["puts"] == 0
    nxt = standby.handle(m.PutStart(client="c", item=m.PutItem(key="z", size=2 * KiB),
                                    reserve_next=True))
    assert isinstance(nxt, m.PutTargets) and nxt.reservation is not None
    seq = int(nxt.reservation.key.rsplit("/", 1)[1])
    assert seq > 1 << 20  # a random base: never a name the old leader's commits consumed


def test_snapshot_lists_each_owner_once() -> None:
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    for i in range(4):
        leader.handle(m.PutStart(client=f"c{i % 2}", item=m.PutItem(key=f"k{i}", size=KiB)))
        if i < 3:
            leader.handle(m.PutEnd(client=f"c{i % 2}", key=f"k{i}"))
    state = msgspec.msgpack.decode(leader.replication.snapshot())
    assert state["owners"] == ["c0", "c1"] and [row[5] for row in state["objs"]] == [0, 1, 0, 1]
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert [o.owner for o in standby.objs.values()] == ["c0", "c1", "c0", "c1"]
    assert standby.objs["k3"].state == ObjState.PENDING and "k3" in standby.objects.pending


def test_a_commit_through_a_gone_reservation_never_replaces_a_stored_value() -> None:
    """Checksums off (-1): a second put of a stored key with a different value of the same size,
    through a reservation the master dropped (revoke, drain, cap) or one consumed for another
    key, is no retry: refused, and the client's two-phase fallback gets EXISTS."""
    core, _ = make(segs=2, dram=256 * KiB)
    t = start(core, "k", checksum=-1, strategy="preferred", preferred=["n0/dram"])
    assert core.handle(m.PutEnd(client="c", key="k")) == m.Ok()
    r = t.reservation
    assert r is not None and core.handle(m.PutRevoke(client="c", key=r.key)) == m.Ok()
    d = start(core, "v", checksum=-1, strategy="preferred", preferred=["n1/dram"]).reservation
    assert d is not None and core.handle(m.PutEnd(client="c", key="v")) == m.Ok()
    assert isinstance(core.handle(Drain(client="n1", segment="n1/dram")), DrainStatus)
    assert d.key not in core.objs
    used = start(core, "w", checksum=-1).reservation
    assert used is not None and core.handle(m.PutEnd(client="c", key="w")) == m.Ok()
    assert isinstance(commit(core, used.key, "x", checksum=-1), m.PutCommitted)
    counters, events = dict(core.counters), list(core.events)
    for name in (r.key, d.key, used.key):  # revoked, dropped by the drain, consumed for "x"
        for key in ("k", "w"):
            msg = commit(core, name, key, checksum=-1, nxt=False)
            assert isinstance(msg, m.Err) and msg.code == C.NOT_PENDING, (name, key, msg)
    again = core.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=SIZE)))
    assert isinstance(again, m.Err) and again.code == C.EXISTS
    assert core.counters == counters and core.events == events
    assert commit(core, used.key, "x", checksum=-1, nxt=False) == m.PutCommitted(reservation=None)


def test_the_record_of_recent_commits_is_bounded_per_client_and_in_clients() -> None:
    core, _ = make(dram=4096 * KiB)
    rs = core.reservations
    r = start(core, "a", size=1).reservation
    assert r is not None
    names = []
    for i in range(reservations.RECENT_PER_CLIENT + 1):
        names.append(r.key)
        done = commit(core, r.key, f"b{i}", size=1)
        assert isinstance(done, m.PutCommitted) and done.reservation is not None
        r = done.reservation
    assert len(rs.recent["c"]) == reservations.RECENT_PER_CLIENT
    assert commit(core, names[0], "b0", size=1, nxt=False).code == C.NOT_PENDING  # type: ignore[union-attr]
    assert commit(core, names[1], "b1", size=1, nxt=False) == m.PutCommitted(reservation=None)
    for i in range(reservations.RECENT_CLIENTS):
        c = f"d{i}"
        got = start(core, f"e{i}", client=c, size=1).reservation
        assert got is not None and isinstance(commit(core, got.key, f"f{i}", client=c, size=1,
                                                     nxt=False), m.PutCommitted)
    assert len(rs.recent) == reservations.RECENT_CLIENTS and "c" not in rs.recent


def test_a_standby_loaded_from_a_snapshot_answers_a_retried_commit() -> None:
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    t = leader.handle(m.PutStart(client="c", item=m.PutItem(key="a", size=KiB),
                                 reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is not None
    leader.handle(m.PutEnd(client="c", key="a"))
    assert isinstance(leader.handle(m.PutCommit(client="c", reservation=t.reservation.key,
                                                item=m.PutItem(key="b", size=KiB))), m.PutCommitted)
    hub.publish()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert standby.reservations.recent == leader.reservations.recent == {
        "c": {t.reservation.key: "b"}}
    standby.replication.take_over()
    assert standby.handle(m.PutCommit(client="c", reservation=t.reservation.key,
                                      item=m.PutItem(key="b", size=KiB))) == m.PutCommitted()
    refused = standby.handle(m.PutCommit(client="c", reservation=t.reservation.key,
                                         item=m.PutItem(key="a", size=KiB)))
    assert isinstance(refused, m.Err) and refused.code == C.NOT_PENDING


def test_a_retried_commit_with_a_checksum_succeeds_after_the_record_forgot_it() -> None:
    core, _ = make(dram=16 * 1024 * 1024)
    r = start(core, "a", size=64).reservation
    assert isinstance(commit(core, r.key, "K", size=64, checksum=12345, nxt=False),
                      m.PutCommitted)  # its reply is lost
    for i in range(reservations.RECENT_CLIENTS):  # the bounded record forgets the client
        got = start(core, f"e{i}", client=f"o{i}", size=64).reservation
        commit(core, got.key, f"f{i}", client=f"o{i}", size=64, nxt=False)
    again = commit(core, r.key, "K", size=64, checksum=12345, nxt=False)  # the RPC retry
    assert isinstance(again, m.PutCommitted), again
    other = commit(core, r.key, "K", size=64, checksum=999, nxt=False)  # not the same bytes
    assert isinstance(other, m.Err) and other.code == m.Code.NOT_PENDING
