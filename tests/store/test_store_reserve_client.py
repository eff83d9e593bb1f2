"""The client's held reservations (`store/client/reserve.py`): when a put asks for one."""

from __future__ import annotations

from yuebing.store import messages as m
from yuebing.store.client.reserve import MAX_HELD, HeldReservations, shape_of


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
