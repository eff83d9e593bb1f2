"""The client's held reservations (`store/client/reserve.py`): when a put asks for one."""

from __future__ import annotations

from yuebing.protocol import store as m
from yuebing.store.client.reserve import MAX_HELD, MAX_PER_SHAPE, HeldReservations, shape_of


def _shape(size: int):
    return shape_of(m.PutItem(key="k", size=size))


def test_asks_on_a_shapes_second_put_and_never_beyond_the_cap() -> None:
    """Cycling through more shapes than the cap must not ask for more: the master would drop
    the oldest reservation each time and its space would wait out the write fence."""
    h = HeldReservations()
    shapes = [_shape(4096 * (i + 1)) for i in range(MAX_HELD + 2)]
    assert [h.want(s) for s in shapes] == [False] * len(shapes)  # first puts: no stream yet
    asked = []
    for s in shapes:  # second round: a stream; keep what is granted
        asked.append(h.want(s))
        if asked[-1]:
            h.keep(s, m.Reservation(key=f"r{len(asked)}", replicas=[], expires_in_s=30.0), 0.0)
    assert asked == [True] * MAX_HELD + [False] * 2
    assert len(h.held) == MAX_HELD
    assert h.want(shapes[0])  # a held shape may always renew its own


def _resv(key: str, expires_in_s: float = 30.0) -> m.Reservation:
    return m.Reservation(key=key, replicas=[m.Replica(segment="n/dram", offset=0)],
                         expires_in_s=expires_in_s)


def test_a_claimed_reservation_is_never_held_again_until_any_copy_is_unusable() -> None:
    """Concurrent puts (`AsyncStoreClient`): a reply still in flight may carry the reservation
    another put claimed (and is writing into, or committed); keeping it would hand it to a
    second put, which would overwrite the committed value."""
    h, s = HeldReservations(), _shape(4096)
    h.keep(s, _resv("r1"), 0.0)
    held, stale = h.claim(s, 1.0)
    assert held is not None and held.key == "r1" and stale is None
    assert h.claim(s, 1.0) == (None, None)  # exactly one put gets it
    h.keep(s, _resv("r1"), 0.5)  # a stale reply carrying it: ignored
    assert h.held == {} and h.claim(s, 2.0) == (None, None)
    h.keep(s, _resv("r2"), 2.0)  # the commit's next reservation is held
    assert [x.key for x in h.held[s]] == ["r2"]
    h.keep(s, _resv("r1"), 2.0)  # and a late copy of r1 does not replace it
    assert [x.key for x in h.held[s]] == ["r2"]
    # once every copy of r1 would be unusable (granted 30 s, deadline 30), it is forgotten
    assert h.claim(s, 59.9)[0] is None and "r1" in h.busy  # r2 (deadline 32) is stale now
    h.claim(s, 60.0)
    assert "r1" not in h.busy


def test_a_refused_commit_releases_the_reservation_and_stale_ones_go_back() -> None:
    h, s = HeldReservations(), _shape(4096)
    h.keep(s, _resv("r1"), 0.0)
    held, _ = h.claim(s, 1.0)
    assert held is not None
    h.release("r1")  # the master refused the commit; it may answer with r1 again
    h.keep(s, _resv("r1"), 2.0)
    assert [x.key for x in h.held[s]] == ["r1"]
    assert h.claim(s, 2.0 + 15.1) == (None, "r1")  # under half its write time left: give back
    assert h.claim(s, 2.0 + 15.1) == (None, None)
    h.keep(s, _resv("r3", 1.0), 0.0)
    assert h.claim(s, 1.5) == (None, None)  # past its write expiry: the master reclaimed it
    assert "r3" in h.busy


def test_batches_take_as_many_as_items_or_none() -> None:
    h, s = HeldReservations(), _shape(4096)
    h.keep_many(s, [_resv(f"r{i}") for i in range(4)], 0.0)
    h.keep_many(s, [_resv("r3"), _resv("r4")], 1.0)  # a reply lists held ones first:
    assert [x.key for x in h.held[s]] == ["r0", "r1", "r2", "r3", "r4"]  # refreshed in place
    assert h.take_many(s, 6, 2.0) == ([], [])  # too few: none taken, all still held
    got, stale = h.take_many(s, 3, 2.0)
    assert [x.key for x in got] == ["r0", "r1", "r2"] and stale == []
    assert [x.key for x in h.held[s]] == ["r3", "r4"]
    got, stale = h.take_many(s, 1, 15.5)  # r3, r4 granted at 1 s: half their time left
    assert [x.key for x in got] == ["r3"] and stale == []
    got, stale = h.take_many(s, 1, 16.5)  # under half: handed back as stale, none taken
    assert got == [] and [x.key for x in stale] == ["r4"] and s not in h.held


def test_lists_are_capped_and_dead_segments_cleared_across_shapes() -> None:
    h, s, t = HeldReservations(), _shape(4096), _shape(8192)
    h.keep_many(s, [_resv(f"r{i}") for i in range(MAX_PER_SHAPE + 3)], 0.0)
    assert [x.key for x in h.held[s]][0] == "r3" and len(h.held[s]) == MAX_PER_SHAPE
    h.keep_many(t, [m.Reservation(key="t0", replicas=[m.Replica(segment="dead/dram", offset=0)],
                                  expires_in_s=30.0), _resv("t1")], 0.0)
    # 66 in all: like the master, the other shape's two oldest make room for t0 and t1
    assert [x.key for x in h.held[s]][0] == "r5" and len(h.held[s]) == MAX_PER_SHAPE - 2
    assert h.touching(["dead/dram"]) == ["t0"]
    assert [x.key for x in h.held[t]] == ["t1"]
    assert len(h.pop_all()) == MAX_PER_SHAPE - 1 and h.held == {}
