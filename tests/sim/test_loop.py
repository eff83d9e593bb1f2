"""Event loop: ordering by time, then priority class, then scheduling order; one seed."""

from __future__ import annotations

import pytest

from yuebing.core.errors import InputError
from yuebing.sim.loop import EventLoop, Priority


def test_events_fire_by_time_then_priority_then_fifo() -> None:
    loop = EventLoop()
    fired: list[str] = []
    loop.at(2.0, Priority.ARRIVAL, fired.append, "arrival@2")
    loop.at(1.0, Priority.SAMPLE, fired.append, "sample@1")
    loop.at(1.0, Priority.ARRIVAL, fired.append, "arrival@1-first")
    loop.at(1.0, Priority.COMPLETE, fired.append, "complete@1")
    loop.at(1.0, Priority.ARRIVAL, fired.append, "arrival@1-second")
    loop.at(0.5, Priority.SAMPLE, fired.append, "sample@0.5")
    assert loop.run() == 6
    assert fired == ["sample@0.5", "complete@1", "arrival@1-first", "arrival@1-second",
                     "sample@1", "arrival@2"]
    assert loop.now == 2.0
    assert loop.events == 6


def test_callbacks_see_their_time_and_can_schedule_now() -> None:
    loop = EventLoop()
    seen: list[tuple[str, float]] = []

    def first() -> None:
        seen.append(("first", loop.now))
        loop.after(0.0, Priority.COMPLETE, lambda: seen.append(("chained", loop.now)))
        loop.after(1.5, Priority.COMPLETE, lambda: seen.append(("later", loop.now)))

    loop.at(3.0, Priority.ARRIVAL, first)
    loop.at(3.0, Priority.SAMPLE, lambda: seen.append(("sample", loop.now)))
    loop.run()
    # the chained COMPLETE at 3.0 was scheduled after the SAMPLE but has a lower class
    assert seen == [("first", 3.0), ("chained", 3.0), ("sample", 3.0), ("later", 4.5)]


def test_run_until_stops_before_later_events() -> None:
    loop = EventLoop()
    fired: list[int] = []
    for t in (1, 2, 3):
        loop.at(float(t), Priority.ARRIVAL, fired.append, t)
    assert loop.run(until=2.5) == 2
    assert fired == [1, 2] and loop.now == 2.5 and loop.pending() == 1
    assert loop.peek_time() == 3.0


def test_scheduling_in_the_past_is_refused_and_changes_nothing() -> None:
    loop = EventLoop(start_s=5.0)
    with pytest.raises(InputError, match="before now"):
        loop.at(4.0, Priority.ARRIVAL, print)
    with pytest.raises(InputError, match="delay"):
        loop.after(-1.0, Priority.ARRIVAL, print)
    with pytest.raises(InputError, match="cannot schedule an event at nan s"):
        loop.at(float("nan"), Priority.ARRIVAL, print)
    with pytest.raises(InputError, match="event delay must be >= 0 s, got nan"):
        loop.after(float("nan"), Priority.ARRIVAL, print)
    assert loop.pending() == 0


def test_one_seed_gives_one_random_stream() -> None:
    a, b, c = EventLoop(seed=7), EventLoop(seed=7), EventLoop(seed=8)
    xs = [a.rng.random() for _ in range(5)]
    assert xs == [b.rng.random() for _ in range(5)]
    assert xs != [c.rng.random() for _ in range(5)]
