"""`core.choices`: a speed-only choice measured on a busy host is provisional — used, then
measured again under the lock by the first process that finds the host quiet —, an engine
choice (``remeasure=False``) stays as first measured, and `host_busy` reads the load of this
process's CPUs less its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from yuebing.core import choices

PARTS = {"kind": "test.quiet", "version": 1}


def _busy(monkeypatch: pytest.MonkeyPatch, shares: list[float]) -> list[float]:
    """`host_busy` answers ``shares`` in turn (the last one from then on); returns the list
    (empty of all but its last when every sample was taken)."""
    def fake() -> float:
        return shares.pop(0) if len(shares) > 1 else shares[0]
    monkeypatch.setattr(choices, "host_busy", fake)
    monkeypatch.delenv("YUEBING_KEEP_CHOICES", raising=False)
    return shares


def _quiet_flag(root: Path) -> bool:
    (kept,) = root.glob("*.json")
    return json.loads(kept.read_text())["quiet"]


def test_a_busy_measurement_is_provisional_until_a_quiet_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.6, 0.6, 0.7])  # before and after the measurement; the next start's
    assert choices.shared_choice(PARTS, lambda: 1, int, tmp_path) == (1, False)
    assert _quiet_flag(tmp_path) is False
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path) == (1, True)  # still busy
    _busy(monkeypatch, [0.05])
    assert choices.shared_choice(PARTS, lambda: 3, int, tmp_path) == (3, False)  # quiet now
    assert _quiet_flag(tmp_path) is True
    left = _busy(monkeypatch, [0.9, 0.9])
    assert choices.shared_choice(PARTS, lambda: 4, int, tmp_path) == (3, True)  # settled
    assert left == [0.9, 0.9]  # read without sampling the host


def test_busy_after_the_measurement_counts_too(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.0, 0.5])
    choices.shared_choice(PARTS, lambda: 1, int, tmp_path)
    assert _quiet_flag(tmp_path) is False


def test_keep_choices_uses_a_provisional_one_as_it_is(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.9])
    choices.shared_choice(PARTS, lambda: 1, int, tmp_path)
    _busy(monkeypatch, [0.0])
    monkeypatch.setenv("YUEBING_KEEP_CHOICES", "1")
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path) == (1, True)


def test_an_engine_choice_is_never_measured_again(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.9])
    choices.shared_choice(PARTS, lambda: 1, int, tmp_path, remeasure=False)
    assert _quiet_flag(tmp_path) is False  # recorded all the same
    _busy(monkeypatch, [0.0])
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path, remeasure=False) == (1, True)


def test_a_choice_kept_before_quietness_was_recorded_counts_as_provisional(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"{choices.choice_key(PARTS)}.json"
    path.write_text(json.dumps({"value": 1, "parts": PARTS}))
    _busy(monkeypatch, [0.0])
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path) == (2, False)


def test_a_failing_measurement_is_not_measured_twice(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.0])
    calls: list[int] = []

    def measure() -> int:
        calls.append(1)
        raise RuntimeError("no kernels")
    with pytest.raises(RuntimeError, match="no kernels"):
        choices.shared_choice(PARTS, measure, int, tmp_path)
    assert calls == [1] and not list(tmp_path.glob("*.json"))


def test_cpu_times_sums_the_lines_of_the_given_cpus(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 10 100 5 0 0 0 0 0\n"
                    "cpu0 4 0 6 50 2 0 0 1 0 0\n"
                    "cpu1 6 0 4 50 3 0 0 0 7 0\n"
                    "intr 12345 0 0\n")
    # busy = user + nice + system + irq + softirq + steal; idle and iowait are not; guest
    # (field 9) is in user already
    assert choices._cpu_times({1}, str(stat)) == (10, 63)
    assert choices._cpu_times({0, 1}, str(stat)) == (21, 126)
    assert choices._cpu_times({5}, str(stat)) is None
    assert choices._cpu_times({0}, str(tmp_path / "missing")) is None


def test_host_busy_counts_other_work_not_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 CPUs at 100 Hz over 0.2 s: 80 jiffies, 40 busy, 20 of them this process's own
    ticks = iter([(100, 1000), (140, 1080)])
    clock = iter([5.0, 5.2])
    monkeypatch.setattr(choices, "_cpu_times", lambda cpus: next(ticks))
    monkeypatch.setattr(choices, "_own_cpu_s", lambda: next(clock))
    monkeypatch.setattr(choices, "_pause", lambda s: None)
    monkeypatch.setattr(choices.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(choices.os, "sysconf", lambda name: 100)
    assert choices.host_busy() == pytest.approx(0.25)


def test_host_busy_sees_another_busy_process() -> None:
    if choices._cpu_times(os.sched_getaffinity(0)) is None:
        pytest.skip("no /proc/stat")
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the spinner gets going: host_busy samples the next 0.2 s
        assert choices.host_busy() >= 0.6 / len(os.sched_getaffinity(0))
    finally:
        spinner.kill()
        spinner.wait()
