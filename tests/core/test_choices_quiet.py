"""`core.choices`: a choice measured on a busy host is provisional — used, then measured again
by the first process that finds the host quiet — and `host_busy` reads the host's load."""

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


def _busy(monkeypatch: pytest.MonkeyPatch, shares: list[float]) -> None:
    """`host_busy` answers ``shares`` in turn (the last one from then on)."""
    def fake() -> float:
        return shares.pop(0) if len(shares) > 1 else shares[0]
    monkeypatch.setattr(choices, "host_busy", fake)
    monkeypatch.setattr(choices, "_busy_after", fake)
    monkeypatch.delenv("YUEBING_KEEP_CHOICES", raising=False)


def _quiet_flag(root: Path) -> bool:
    (kept,) = root.glob("*.json")
    return json.loads(kept.read_text())["quiet"]


def test_a_busy_measurement_is_provisional_until_a_quiet_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _busy(monkeypatch, [0.6, 0.6, 0.7])  # before, after the measurement; the next start's
    assert choices.shared_choice(PARTS, lambda: 1, int, tmp_path) == (1, False)
    assert _quiet_flag(tmp_path) is False
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path) == (1, True)  # still busy
    _busy(monkeypatch, [0.05])
    assert choices.shared_choice(PARTS, lambda: 3, int, tmp_path) == (3, False)  # quiet now
    assert _quiet_flag(tmp_path) is True
    _busy(monkeypatch, [0.9])
    assert choices.shared_choice(PARTS, lambda: 4, int, tmp_path) == (3, True)  # settled


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


def test_a_choice_kept_before_quietness_was_recorded_counts_as_provisional(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / f"{choices.choice_key(PARTS)}.json"
    path.write_text(json.dumps({"value": 1, "parts": PARTS}))
    _busy(monkeypatch, [0.0])
    assert choices.shared_choice(PARTS, lambda: 2, int, tmp_path) == (2, False)


def test_host_busy_counts_other_processes_not_this_ones_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 CPUs, 0.2 s: 40 of 80 jiffies busy; this process ran 0.2 s (one CPU) of them
    ticks = iter([(100, 1000), (140, 1080)])
    clock = iter([5.0, 5.2])
    monkeypatch.setattr(choices, "_cpu_times", lambda: next(ticks))
    monkeypatch.setattr(choices.time, "process_time", lambda: next(clock))
    monkeypatch.setattr(choices.time, "sleep", lambda s: None)
    monkeypatch.setattr(choices.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(choices, "_sampled", None)
    assert choices.host_busy() == pytest.approx(0.5 - 0.25)
    assert choices.host_busy() == pytest.approx(0.25)  # reused within a second


def test_host_busy_sees_another_busy_process(monkeypatch: pytest.MonkeyPatch) -> None:
    if choices._cpu_times() is None:
        pytest.skip("no /proc/stat")
    cpus = os.cpu_count() or 1
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        monkeypatch.setattr(choices, "_sampled", None)
        assert choices.host_busy() >= 0.6 / cpus  # one busy CPU of ``cpus``
    finally:
        spinner.kill()
        spinner.wait()
