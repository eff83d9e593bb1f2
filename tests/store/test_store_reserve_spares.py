"""Reservations made ahead (issue 29): after a `PutCommit` the master makes the client's next
reservation once the replies are out (`MasterCore.idle`), and the next commit hands that spare
out instead of placing one while its client waits. A spare no reply named was never written:
it is freed unfenced when it expires, turns stale or its client gives reservations back; once
named it is an ordinary reservation, fenced like any. A new leader knows no spares (virtual
clock, no sockets)."""

from __future__ import annotations

from master_factories import SIZE, KiB, commit, durable, leader_and_standby, make, ship, start

from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Mount

C = m.Code


def _stream(core, n: int, client: str = "c", prefix: str = "c", **kw) -> m.Reservation:
    """``n`` puts of one shape (keys ``prefix/i``) through reservations, `idle` after each
    reply (as the service does); the reservation the last reply handed out."""
    t = start(core, f"{prefix}/0", client=client, **kw)
    core.handle(m.PutEnd(client=client, key=f"{prefix}/0"))
    r = t.reservation
    for i in range(1, n):
        done = commit(core, r.key, f"{prefix}/{i}", client=client, **kw)
        assert isinstance(done, m.PutCommitted) and done.reservation is not None, done
        r = done.reservation
        core.idle()
    return r


def test_the_next_commit_hands_out_the_spare_made_after_the_reply() -> None:
    core, _ = make(dram=64 * KiB)
    r = _stream(core, 2)  # the second put's commit placed its successor while the client waited
    spares = dict(core.reservations.spares)
    assert len(spares) == 1 and r.key not in spares
    made = core.counters["reservations_made"]
    done = commit(core, r.key, "c/2")
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    assert done.reservation.key in spares  # handed out, not placed now
    assert core.counters["reservations_made"] == made and not core.reservations.spares
    st = core.stats().values
    assert (st["reservations"], st["reservations_spare"]) == (1, 0)
    core.idle()
    st = core.stats().values
    assert (st["reservations"], st["reservations_spare"], st["objects"]) == (2, 1, 3)
    assert st["dram_used"] == 5 * SIZE  # three values, the held one and the spare


def test_an_unnamed_spare_expires_unfenced_a_named_one_is_fenced() -> None:
    core, clock = make(dram=64 * KiB, put_timeout_s=5.0)
    held = _stream(core, 3, timeout_s=1.0)
    (spare,) = core.reservations.spares
    clock.advance_to(clock.now() + 1.5)  # both past their write expiry
    core.tick()
    assert held.key not in core.objs and spare not in core.objs
    assert core.counters["reservations_expired"] == 2
    assert core.counters["quarantined"] == 1  # the named one only: a write may be under way
    assert core.stats().values["quarantined_bytes"] == SIZE


def test_a_stale_spare_is_freed_and_a_fresh_one_placed() -> None:
    core, clock = make(dram=64 * KiB, put_timeout_s=5.0)
    held = _stream(core, 3, timeout_s=1.0)
    (spare,) = core.reservations.spares
    clock.advance_to(clock.now() + 0.6)  # under half of the spare's write time is left
    done = commit(core, held.key, "c/3", timeout_s=1.0)
    assert isinstance(done, m.PutCommitted) and done.reservation is not None
    assert done.reservation.key != spare and spare not in core.objs
    assert done.reservation.expires_in_s == 1.0 and core.counters["quarantined"] == 0


def test_give_back_frees_the_spares_unfenced() -> None:
    core, _ = make(dram=64 * KiB)
    held = _stream(core, 3)
    (spare,) = core.reservations.spares
    got = core.handle(m.BatchPutRevoke(client="c", keys=[], failed=[], unused=[held.key]))
    assert got == m.Codes(codes=[int(C.OK)])
    assert spare not in core.objs and held.key not in core.objs
    st = core.stats().values
    assert (st["reservations"], st["reservations_spare"], st["quarantined_bytes"]) == (0, 0, 0)
    assert st["dram_used"] == 3 * SIZE


def test_spares_never_hold_a_new_shape_back() -> None:
    core, _ = make(dram=256 * KiB)
    for size in (1, 2, 3, 4):  # four shapes, each with a held reservation and a spare
        held = _stream(core, 3, prefix=f"s{size}", size=size * KiB)
        core.reserve.drop(held.key, "expired")  # as at its write expiry: the spare is left
    assert len(core.reservations.spares) == 4 and core.counters["quarantined"] == 4
    t = start(core, "new", size=5 * KiB)  # a fifth shape still gets its reservation
    assert t.reservation is not None and not core.reservations.spares
    assert core.counters["quarantined"] == 4  # the spares went unfenced


def test_spares_replicate_and_a_new_leader_fences_them() -> None:
    leader, standby, hub = leader_and_standby()
    leader.handle(Mount(client="n0", segment="s0", size=64 * KiB))
    hub.publish()
    standby.replication.load_snapshot(hub.subscribe("sb", 1).state)
    _stream(leader, 3, size=KiB)
    (spare,) = leader.reservations.spares
    ship(hub, standby)
    assert durable(standby) == durable(leader) and spare in standby.objs
    standby.replication.take_over()
    assert not standby.reservations.spares  # every reservation may have been named: fenced
    assert standby.stats().values["reservations"] == 2


def test_a_retried_commit_answers_the_reservation_its_first_reply_named() -> None:
    core, _ = make(dram=64 * KiB)
    held = _stream(core, 2)
    first = commit(core, held.key, "c/2")  # its reply is lost; the spare is made meanwhile
    assert isinstance(first, m.PutCommitted) and first.reservation is not None
    core.idle()
    again = commit(core, held.key, "c/2")
    assert isinstance(again, m.PutCommitted) and again.reservation is not None
    assert again.reservation.key == first.reservation.key  # not the new spare
    assert len(core.reservations.spares) == 1
