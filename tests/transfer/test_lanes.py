"""`transfer.lanes`: the lane count is measured once per machine and kept; the next engine
reads it, another machine measures again, a flag wins, and a failed measurement keeps nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from yuebing.core.errors import TransferError
from yuebing.transfer import TransferConfig, TransferEngine
from yuebing.transfer import lanes as ln


class Counting:
    """Builds real initiator engines, counting the lane counts asked for."""

    def __init__(self) -> None:
        self.made: list[int] = []

    def __call__(self, cfg: TransferConfig) -> TransferEngine:
        self.made.append(cfg.lanes)
        return TransferEngine(cfg)


def test_measured_once_kept_and_measured_again_on_another_machine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ln, "machine_parts", lambda: {"cpu": "test cpu", "cpus": 2})
    make = Counting()
    cfg, how = ln.resolve_lanes(TransferConfig(), make, tmp_path)
    assert how == "measured now" and make.made == [1, 2, 4]  # 8 lanes not tried on 2 CPUs
    assert cfg.lanes in (1, 2, 4) and len(list(tmp_path.glob("*.json"))) == 1
    again, how = ln.resolve_lanes(TransferConfig(), make, tmp_path)
    assert (again.lanes, how) == (cfg.lanes, "kept for this machine") and len(make.made) == 3
    monkeypatch.setattr(ln, "machine_parts", lambda: {"cpu": "other cpu", "cpus": 8})
    _, how = ln.resolve_lanes(TransferConfig(), make, tmp_path)
    assert how == "measured now" and make.made[3:] == [1, 2, 4, 8]
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_measuring_engines_never_take_the_callers_port_or_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ln, "machine_parts", lambda: {"cpu": "test cpu", "cpus": 1})
    with TransferEngine(TransferConfig(lanes=1)) as holder:  # the caller's port, taken
        port = int(holder.address.rpartition(":")[2])
        make = Counting()
        cfg, how = ln.resolve_lanes(TransferConfig(port=port, engine_id="mine"), make, tmp_path)
    assert how == "measured now" and make.made == [1, 2] and cfg.port == port


def test_a_flag_wins_and_no_tcp_measures_nothing(tmp_path: Path) -> None:
    make = Counting()
    assert ln.resolve_lanes(TransferConfig(lanes=3), make, tmp_path) == \
        (TransferConfig(lanes=3), "configured")
    cfg, how = ln.resolve_lanes(TransferConfig(transports=("shm",)), make, tmp_path)
    assert (cfg.lanes, how) == (ln.FALLBACK, "not used")
    assert make.made == [] and list(tmp_path.glob("*.json")) == []
    with TransferEngine(TransferConfig(lanes=2)) as eng:
        assert (eng.config.lanes, eng.lanes_from, eng.stats()["lanes"]) == (2, "configured", 2)


def test_a_failed_measurement_falls_back_and_keeps_nothing(tmp_path: Path) -> None:
    def broken(cfg: TransferConfig) -> TransferEngine:
        raise TransferError("no engine here")

    cfg, how = ln.resolve_lanes(TransferConfig(), broken, tmp_path)
    assert (cfg.lanes, how) == (ln.FALLBACK, "fallback")
    assert list(tmp_path.glob("*.json")) == []


def test_pick_takes_more_lanes_only_when_they_win_by_the_margin() -> None:
    assert ln.pick({1: 10.0, 2: 9.6, 4: 9.0}) == 4
    assert ln.pick({1: 10.0, 2: 9.6, 4: 9.55}) == 1
    assert ln.pick({1: 10.0, 2: 8.0, 4: 7.8, 8: 7.0}) == 8
    assert ln.candidates(1) == (1, 2) and ln.candidates(2) == (1, 2, 4)
    assert ln.candidates(16) == ln.CANDIDATES


@pytest.mark.parametrize("raw", [[0, {}], [65, {}], ["4", {}], [4, []], [4]])
def test_a_malformed_kept_choice_is_refused(raw: object) -> None:
    with pytest.raises((TypeError, ValueError)):
        ln.lanes_choice(raw)


def test_a_first_engine_measures_without_waiting_on_its_own_choice_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane measurement holds the choices' lock while its target process starts; the
    target must not ask for a choice under that lock (it waited 60 s and fell back)."""
    import time

    from yuebing.transfer import streamcopy
    if not streamcopy.BUILT:
        pytest.skip("the streaming-copy extension is not built: the target never asks")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing kept: both kinds measure
    t0 = time.monotonic()
    cfg, how = ln.resolve_lanes(TransferConfig(), TransferEngine)
    assert how == "measured now" and time.monotonic() - t0 < ln.TARGET_READY_S / 2
    assert list((tmp_path / "yuebing" / "choices").glob("*.json"))
