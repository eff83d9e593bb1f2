"""`Spinner`: returns as soon as the poll is ready, is bounded by its window, and turns itself
off (with a doubling back-off) when a yield shows the CPU went to other work."""

from __future__ import annotations

import time

import pytest

from yuebing.core import spin
from yuebing.core.spin import GapPredictor, Spinner


class Poll:
    """A poll that becomes ready on its ``ready_at``-th call (never with 0)."""

    def __init__(self, ready_at: int = 0) -> None:
        self.calls = 0
        self.ready_at = ready_at

    def __call__(self) -> list[str]:
        self.calls += 1
        return ["ready"] if self.calls == self.ready_at else []


def test_returns_the_ready_result_without_waiting_out_the_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spin, "LOST_S", float("inf"))  # no early stop on a loaded machine
    p = Poll(ready_at=3)
    t0 = time.perf_counter()
    assert Spinner().wait(p, 1.0) == ["ready"]
    assert p.calls == 3
    assert time.perf_counter() - t0 < 0.5


def test_window_bounds_the_spin_and_zero_polls_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # only the window ends this spin: a yield that loses the CPU to another process on a
    # loaded machine would end it early by design (test_lost_cpu_turns_spinning_off_...)
    monkeypatch.setattr(spin, "LOST_S", float("inf"))
    s = Spinner()
    p = Poll()
    t0, c0 = time.perf_counter(), time.process_time()
    assert s.wait(p, 0.01) == []
    assert 0.01 <= time.perf_counter() - t0 < 0.5
    assert time.process_time() - c0 < 0.3
    assert p.calls > 1
    q = Poll()
    assert s.wait(q, 0.0) == [] and q.calls == 1


def test_lost_cpu_turns_spinning_off_with_doubling_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spin.os, "sched_yield", lambda: time.sleep(0.002))  # another task runs
    s = Spinner()
    p = Poll()
    assert s.wait(p, 1.0) == []
    assert (p.calls, s.lost, s.enabled) == (2, 1, False)  # one yield, then off
    q = Poll()
    assert s.wait(q, 1.0) == [] and q.calls == 1  # backed off: a single poll
    s._off_until = 0.0  # the back-off period is over
    assert s.wait(Poll(), 1.0) == [] and s.lost == 2
    assert s._backoff == pytest.approx(4 * spin.BACKOFF_S)
    for _ in range(10):
        s._off_until = 0.0
        s.wait(Poll(), 1.0)
    assert s._backoff == spin.MAX_BACKOFF_S


def test_a_peer_answering_during_a_long_yield_is_not_a_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spin.os, "sched_yield", lambda: time.sleep(0.002))  # the peer ran
    s = Spinner()
    assert s.wait(Poll(ready_at=2), 1.0) == ["ready"]
    assert (s.lost, s.enabled) == (0, True)


def test_spins_that_catch_their_event_halve_the_backoff_slowly() -> None:
    """One catch saves a wake-up, one loss costs a time slice: `CATCHES_TO_HALVE` catches
    halve the back-off, not one (which let a busy machine lose a slice every few calls)."""
    s = Spinner()
    s._backoff = 8 * spin.BACKOFF_S
    assert s.wait(Poll(ready_at=2), 1.0) == ["ready"]
    assert 4 * spin.BACKOFF_S < s._backoff < 8 * spin.BACKOFF_S
    for _ in range(spin.CATCHES_TO_HALVE - 1):
        s.wait(Poll(ready_at=2), 1.0)
    assert s._backoff == pytest.approx(4 * spin.BACKOFF_S)
    for _ in range(2 * spin.CATCHES_TO_HALVE + 1):
        s.wait(Poll(ready_at=2), 1.0)
    assert s._backoff == spin.BACKOFF_S


def test_gap_predictor_spins_only_while_arrivals_come_within_the_window() -> None:
    g = GapPredictor(window_s=0.001, alpha=0.5)
    assert g.arrived(10.0) == 10.001  # first arrival: optimistic
    assert g.arrived(10.0002) == pytest.approx(10.0012)  # mean gap 0.1 ms
    # a trickle 3 ms apart (capped at 4 windows = 4 ms): mean 1.55 ms > 1 ms → no spinning
    assert g.arrived(10.0032) == 0.0
    assert g.mean == pytest.approx(0.00155)
    assert g.arrived(10.0062) == 0.0  # mean 2.275 ms
    # a burst of quick requests brings it back: 2.275 → 1.1875 → 0.64375 ms
    assert g.arrived(10.0063) == 0.0
    assert g.arrived(10.0064) == pytest.approx(10.0074)
    # one long idle period counts as 4 windows only
    assert g.arrived(99.0) == 0.0 and g.mean == pytest.approx(0.00232188, rel=1e-4)


# ---------------------------------------------------------------- windows chosen per machine
def test_window_configured_is_kept_and_auto_is_chosen_for_the_machine(monkeypatch) -> None:
    assert spin.window_s(0, 500) == 0.0
    assert spin.window_s(70, 500) == pytest.approx(70e-6)
    ref = spin.Machine(cpus=2, wake_us=20.0, step_us=spin.REF_STEP_US)
    monkeypatch.setattr(spin, "machine", lambda: ref)
    assert spin.window_s(spin.AUTO, 500) == pytest.approx(500e-6)  # the reference core


@pytest.mark.parametrize(("cpus", "wake_us", "step_us", "window_us"), [
    (1, 20.0, spin.REF_STEP_US, 0),  # one CPU: the awaited peer needs it
    (8, 0.5, spin.REF_STEP_US, 0),  # wake-ups as cheap as a poll: nothing to save
    (8, 20.0, 2 * spin.REF_STEP_US, 200),  # a core half as fast: twice the window
    (8, 20.0, spin.REF_STEP_US / 2, 50),
    (8, 20.0, 100 * spin.REF_STEP_US, 400),  # scaled at most 4x either way
])
def test_machine_window(cpus: int, wake_us: float, step_us: float, window_us: int) -> None:
    assert spin.Machine(cpus, wake_us, step_us).window_us(100) == window_us


def test_machine_is_measured_once_and_quickly() -> None:
    t0 = time.perf_counter()
    m = spin.machine()
    assert spin.machine() is m
    assert m.cpus >= 1 and m.wake_us >= 0.0 and m.step_us > 0.0
    assert time.perf_counter() - t0 < 2.0
