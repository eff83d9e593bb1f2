"""Replication: a standby core fed the leader's snapshot and entries ends with the same durable
metadata, and after take-over its allocators never hand out a range a committed value uses."""

from __future__ import annotations

from master_factories import KiB, durable, leader_and_standby, ship

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount, Unmount
from yuebing.store.master.state import ObjState


def test_snapshot_then_entries_reproduce_durable_state() -> None:
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    for i in range(3):
        leader.handle(m.PutStart(client="c", item=m.PutItem(key=f"k{i}", size=KiB, checksum=i)))
        leader.handle(m.PutEnd(client="c", key=f"k{i}"))
    hub.publish()  # entries before the subscription are inside the snapshot
    snap = hub.subscribe("sb", 1)
    standby.replication.load_snapshot(snap.state)
    assert durable(standby) == durable(leader)
    leader.handle(Mount(client="n1", segment="s1", size=64 * KiB))
    leader.handle(m.PutStart(client="c", item=m.PutItem(key="p", size=2 * KiB,
                                                        strategy="preferred", preferred=["s1"])))
    leader.handle(m.Remove(key="k1"))
    leader.handle(m.Pin(keys=["k2"], hard=True))
    ship(hub, standby)
    assert durable(standby) == durable(leader)
    assert standby.objs["p"].state == ObjState.PENDING and "p" in standby.objects.pending
    leader.handle(m.PutEnd(client="c", key="p"))
    leader.handle(Unmount(client="n0", segment="s0"))
    ship(hub, standby)
    assert durable(standby) == durable(leader)
    assert sorted(standby.objs) == ["p"]


def test_take_over_rebuilds_allocators_without_overlap() -> None:
    leader, standby, hub = leader_and_standby()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    leader.handle(Mount(client="n0", segment="s0", size=8 * KiB))
    for i in range(4):
        leader.handle(m.PutStart(client="c", item=m.PutItem(key=f"k{i}", size=KiB)))
        leader.handle(m.PutEnd(client="c", key=f"k{i}"))
    leader.handle(m.Remove(key="k1"))
    ship(hub, standby)
    standby.replication.take_over()
    used = {o.reps[0][1] for o in standby.objs.values()}
    assert used == {0, 2 * KiB, 3 * KiB}
    r = standby.handle(m.PutStart(client="c", item=m.PutItem(key="new", size=2 * KiB)))
    assert r.replicas[0].offset == 4 * KiB  # best fit: the 4 KiB tail, never a used range
    r = standby.handle(m.PutStart(client="c", item=m.PutItem(key="new2", size=KiB)))
    assert r.replicas[0].offset == KiB  # the hole k1 left
    assert standby.log == [["put", "new", 2 * KiB, -1, [(1, 4 * KiB)], "c", False, 0.0],
                           ["put", "new2", KiB, -1, [(1, KiB)], "c", False, 0.0]]


def test_sync_replication_holds_replies_until_acked_and_drops_silent_standby() -> None:
    leader, _, hub = leader_and_standby()
    hub.subscribe("sb", 7)
    leader.handle(Mount(client="n0", segment="s0", size=8 * KiB))
    (ident, msg), = hub.publish()
    assert ident == 7 and msg.first_seq == 1 and len(msg.entries) == 1
    hub.hold((1, 1, b"reply"))
    assert hub.releasable() == []
    hub.ack("sb", 1)
    assert hub.releasable() == [(1, 1, b"reply")]
    leader.handle(m.PutStart(client="c", item=m.PutItem(key="k", size=KiB)))
    hub.publish()
    hub.hold((1, 2, b"r2"))
    leader.clock.advance_to(10.5)
    assert hub.releasable() == []
    leader.clock.advance_to(11.5)  # no ack for > repl_timeout_s: dropped, replies released
    assert hub.releasable() == [(1, 2, b"r2")] and hub.standbys == {}


def test_take_over_leases_every_value_for_a_lease_ttl() -> None:
    """Leases are not replicated: a reader the old leader served may still be copying, so the
    new leader must neither evict nor (unforced) remove anything until such a lease is over."""
    leader, standby, hub = leader_and_standby()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    leader.handle(Mount(client="n0", segment="s0", size=4 * KiB))
    for i in range(4):
        leader.handle(m.PutStart(client="c", item=m.PutItem(key=f"k{i}", size=KiB)))
        leader.handle(m.PutEnd(client="c", key=f"k{i}"))
    leader.handle(m.GetReplicas(key="k0"))  # a lease the standby never hears of
    ship(hub, standby)
    standby.replication.take_over()
    ttl = standby.cfg.lease_ttl_s
    r = standby.handle(m.PutStart(client="c", item=m.PutItem(key="new", size=KiB)))
    assert isinstance(r, m.Err) and r.code == m.Code.NO_SPACE  # full, and nothing evictable
    assert standby.handle(m.Remove(key="k0")).code == m.Code.LEASED  # type: ignore[union-attr]
    standby.clock.advance_to(standby.clock.now() + ttl + 0.1)  # type: ignore[attr-defined]
    r = standby.handle(m.PutStart(client="c", item=m.PutItem(key="new", size=KiB)))
    assert isinstance(r, m.PutTargets)  # an old value was evicted for it
    assert "new" in standby.objs and len(standby.objs) == 4


def test_reservations_and_their_commits_replicate_and_survive_take_over() -> None:
    """A reservation (snapshot) and a PutCommit's rename + commit (entries) reach the standby;
    after take-over the client's reservation from the old leader commits on the new one."""
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    t = leader.handle(m.PutStart(client="c", item=m.PutItem(key="a", size=KiB), reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is not None
    leader.handle(m.PutEnd(client="c", key="a"))
    hub.publish()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    assert durable(standby) == durable(leader)
    assert standby.reservations.by_key == leader.reservations.by_key != {}
    done = leader.handle(m.PutCommit(client="c", reservation=t.reservation.key, item=m.PutItem(
        key="b", size=KiB, checksum=9, hard_pin=True), reserve_next=True))
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    ship(hub, standby)
    assert durable(standby) == durable(leader)
    assert standby.reservations.by_key == leader.reservations.by_key
    assert t.reservation.key not in standby.objs and standby.objs["b"].state == ObjState.COMMITTED
    assert list(standby.objs) == list(leader.objs)  # same recency order
    standby.replication.take_over()
    r = standby.handle(m.PutCommit(client="c", reservation=done.reservation.key,
                                   item=m.PutItem(key="c", size=KiB), reserve_next=True))
    assert isinstance(r, m.PutCommitted) and r.reservation is not None
    offsets = [o.reps[0][1] for o in standby.objs.values()]
    assert sorted(offsets) == [0, KiB, 2 * KiB, 3 * KiB]  # a, b, c, the next: no overlap
    assert standby.log[:2] == [["rename", done.reservation.key, "c", -1, False, 0.0],
                               ["commit", "c"]]
    assert [e[0] for e in standby.log[2:]] == ["put", "resv"]
    assert standby.handle(m.Exists(key="c")) == m.Bools(values=[True])
