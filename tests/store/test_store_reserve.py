"""Reservations of the master core (one-RPC puts): invisible, renamed and committed by
PutCommit, refused precisely, reclaimed and fenced when abandoned (virtual clock, no sockets)."""

from __future__ import annotations

from master_factories import SIZE, KiB, commit, exists, make, put, start

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, EventKind, Mount, Unmount

C = m.Code


def test_reservation_is_invisible_to_every_listing_probe_and_removal() -> None:
    core, _ = make()
    t = start(core, "a")
    assert core.handle(m.PutEnd(client="c", key="a")) == m.Ok()
    r = t.reservation
    assert r is not None and r.key.startswith(m.RESERVED_PREFIX)
    assert r.replicas == [m.Replica(segment="n0/dram", offset=SIZE)] and r.expires_in_s == 30.0
    assert exists(core, "a", r.key) == [True, False]
    assert core.handle(m.Exists(key=r.key)) == m.Bools(values=[False])
    assert core.handle(m.PrefixMatch(keys=["a", r.key])) == m.Count(n=1)
    assert core.handle(m.GetReplicas(key=r.key)).code == C.NOT_FOUND  # type: ignore[union-attr]
    assert core.handle(m.Pin(keys=[r.key], hard=True)) == m.Codes(codes=[int(C.NOT_FOUND)])
    assert core.handle(m.RemovePrefix(prefix=m.RESERVED_PREFIX, force=True)) == m.Removed(n=0)
    assert core.handle(m.RemoveAll(force=True)) == m.Removed(n=1)  # "a" only
    assert core.eviction.evict_for(64 * KiB) == 0  # nothing committed left; never the reservation
    assert r.key in core.objs and core.events[-1] == (EventKind.REMOVED, "a", ["n0/dram"])
    st = core.stats().values
    assert (st["objects"], st["pending"], st["reservations"]) == (0, 0, 1)
    assert st["dram_used"] == SIZE
    # nobody may touch the reserved namespace as a key
    bad = core.handle(m.PutStart(client="c", item=m.PutItem(key=r.key, size=SIZE)))
    assert isinstance(bad, m.Err) and bad.code == C.BAD_REQUEST and "reserved" in bad.message
    bad = core.handle(m.PutEnd(client="c", key=r.key))
    assert isinstance(bad, m.Err) and bad.code == C.BAD_REQUEST and "PutCommit" in bad.message
    assert commit(core, r.key, m.RESERVED_PREFIX + "x").code == C.BAD_REQUEST  # type: ignore[union-attr]
    assert r.key in core.objs


def test_commit_renames_commits_applies_pins_and_hands_out_the_next() -> None:
    core, _ = make()
    r = start(core, "a").reservation
    core.handle(m.PutEnd(client="c", key="a"))
    assert r is not None
    done = commit(core, r.key, "b", checksum=77, hard_pin=True)
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    assert done.reservation.key != r.key and done.reservation.replicas[0].offset == 2 * SIZE
    assert exists(core, "b") == [True] and r.key not in core.objs
    assert core.handle(m.Remove(key="b")).code == C.PINNED  # type: ignore[union-attr]
    got = core.handle(m.GetReplicas(key="b"))
    assert got == m.ReplicaList(key="b", size=SIZE, checksum=77, replicas=r.replicas,
                                lease_s=core.cfg.lease_ttl_s, lease_id=got.lease_id)
    assert core.events[-1] == (EventKind.STORED, "b", ["n0/dram"])
    assert core.counters["puts"] == 2 and core.counters["reservations_committed"] == 1
    last = commit(core, done.reservation.key, "c", nxt=False)
    assert last == m.PutCommitted(reservation=None) and core.stats().values["reservations"] == 0


def test_refusals_are_precise_and_keep_a_usable_reservation() -> None:
    core, _ = make()
    put(core, "taken")
    r = start(core, "a").reservation
    assert r is not None
    for msg, code, text in (
            (commit(core, r.key, "x", size=SIZE + 1), C.BAD_REQUEST, "was placed for"),
            (commit(core, r.key, "x", replicas=2), C.BAD_REQUEST, "was placed for"),
            (commit(core, r.key, "x", client="other"), C.NOT_PENDING, "another client"),
            (commit(core, r.key, "taken"), C.EXISTS, "exists"),
            (commit(core, r.key, "a"), C.EXISTS, "exists"),  # pending keys exist too
            (commit(core, "\x00resv/c/99", "x"), C.NOT_PENDING, "no reservation"),
            (commit(core, r.key, "x", size=0), C.BAD_REQUEST, "size")):
        assert isinstance(msg, m.Err) and msg.code == code and text in msg.message, msg
    assert r.key in core.objs and exists(core, "x") == [False]
    assert isinstance(commit(core, r.key, "x"), m.PutCommitted)
    assert exists(core, "x") == [True]


def test_asking_again_returns_the_same_reservation_and_a_shape_over_the_cap_gets_none() -> None:
    """Issue 15 item 10: a fifth shape used to drop the client's oldest shape's reservations,
    whose space then waited out the write fence unused (33 s): now it gets none, nothing is
    dropped and nothing is quarantined."""
    core, _ = make(dram=256 * KiB)
    t = start(core, "a")
    assert start(core, "a") == t  # a retried request (lost reply): same targets, same reservation
    assert start(core, "b").reservation == t.reservation  # same shape: the one it has
    keys = [t.reservation.key]  # type: ignore[union-attr]
    for i in range(1, 4):  # three more shapes: within the cap (4)
        keys.append(start(core, f"s{i}", size=SIZE + i * KiB).reservation.key)  # type: ignore[union-attr]
    for i in range(4, 8):  # cycling through more shapes: none for them, none dropped
        t = core.handle(m.PutStart(client="c", item=m.PutItem(key=f"s{i}", size=SIZE + i * KiB),
                                   reserve_next=True))
        assert isinstance(t, m.PutTargets) and t.reservation is None
    assert all(k in core.objs for k in keys) and len(core.fence.quarantine) == 0
    assert core.stats().values["quarantined_bytes"] == 0
    assert isinstance(commit(core, keys[0], "x"), m.PutCommitted)
    other = start(core, "o", client="d").reservation  # another client has its own
    assert other is not None and other.key not in keys


def test_abandoned_reservation_reclaimed_at_its_write_expiry_and_fenced() -> None:
    core, clock = make(dram=8 * KiB, put_timeout_s=5.0)
    r = start(core, "a", timeout_s=1.0, hard_pin=True).reservation  # "a" cannot be evicted
    assert r is not None and r.expires_in_s == 1.0
    core.handle(m.PutEnd(client="c", key="a"))
    clock.advance_to(101.5)
    core.tick()
    assert r.key not in core.objs and core.counters["reservations_expired"] == 1
    assert core.counters["zombies"] == 0 and core.counters["quarantined"] == 1
    assert core.stats().values["quarantined_bytes"] == SIZE  # held until 101 + 1 + 2
    assert core.handle(m.PutStart(client="c", item=m.PutItem(key="b", size=SIZE))).code == C.NO_SPACE  # type: ignore[union-attr]
    assert commit(core, r.key, "b").code == C.NOT_PENDING  # type: ignore[union-attr]
    clock.advance_to(104.01)
    core.tick()
    assert put(core, "b") == m.Ok()


def test_commit_past_write_expiry_is_refused_and_drops_the_reservation() -> None:
    core, clock = make(put_timeout_s=5.0)
    r = start(core, "a", timeout_s=1.0).reservation
    assert r is not None
    clock.advance_to(101.25)  # the tick has not reclaimed it yet
    late = commit(core, r.key, "b", timeout_s=1.0)
    assert isinstance(late, m.Err) and late.code == C.NOT_PENDING and "write expiry" in late.message
    assert r.key not in core.objs and exists(core, "b") == [False]
    assert core.counters["quarantined"] == 1


def test_drain_unmount_and_session_expiry_drop_reservations() -> None:
    core, clock = make(segs=2, client_ttl_s=3.0)
    r0 = start(core, "a", strategy="preferred", preferred=["n0/dram"]).reservation
    r1 = start(core, "b", strategy="preferred", preferred=["n1/dram"]).reservation
    assert r0 is not None and r1 is not None and r0.replicas[0].segment == "n0/dram"
    assert core.handle(Drain(client="n0", segment="n0/dram")).at_risk == 1  # "a" only
    assert r0.key not in core.objs and r1.key in core.objs
    r2 = start(core, "c").reservation  # n0 drains: placed on n1
    assert r2 is not None and [x.segment for x in r2.replicas] == ["n1/dram"]
    assert core.handle(Unmount(client="n1", segment="n1/dram")) == m.Ok()
    assert r1.key not in core.objs and r2.key not in core.objs
    core.handle(Mount(client="n2", segment="n2/dram", size=64 * KiB))
    r3 = start(core, "d").reservation
    assert r3 is not None and r3.key in core.objs
    clock.advance_to(104.0)
    core.handle(m.Heartbeat(client="n2"))
    core.handle(m.Heartbeat(client="n0"))
    core.tick()  # client "c" silent past client_ttl_s: its pending puts and reservation go
    assert r3.key not in core.objs and len(core.reservations) == 0


def test_reservations_are_placed_from_free_space_only() -> None:
    """A speculative reservation never evicts a stored value nor counts as ``no_space``: on a
    full cache the reply carries none (the next put goes the two-phase way)."""
    core, clock = make(dram=16 * SIZE)
    for i in range(16):
        assert put(core, f"k{i}") == m.Ok()
    clock.advance_to(clock.now() + 100)  # leases over: every value is evictable
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="x", size=SIZE), reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is None  # "x" evicted one value
    assert core.handle(m.PutEnd(client="c", key="x")) == m.Ok()
    for c in "def":  # other clients: each put evicts one value for itself, no more
        t = core.handle(m.PutStart(client=c, item=m.PutItem(key=f"y{c}", size=SIZE),
                                   reserve_next=True))
        assert isinstance(t, m.PutTargets) and t.reservation is None
    assert (core.counters["evictions"], core.counters["no_space"]) == (4, 0)
    assert sum(exists(core, *[f"k{i}" for i in range(16)])) == 12
    assert core.stats().values["reservations"] == 0
    core.handle(m.Remove(key="x"))  # free room again: the reservation is placed
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="z", size=SIZE), reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is None  # "z" took the freed room
    core.handle(m.Remove(key="k15"))
    core.handle(m.Remove(key="k14"))
    t = core.handle(m.PutStart(client="c", item=m.PutItem(key="w", size=SIZE), reserve_next=True))
    assert isinstance(t, m.PutTargets) and t.reservation is not None
    assert core.counters["evictions"] == 4 and core.counters["no_space"] == 0
