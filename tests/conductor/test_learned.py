"""`LearnedState`: the TBT tail, decode durations and prefill scale kept per configuration,
taken by a fresh Conductor on the same one, refused (and relearned) on another or corrupt."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from yuebing.conductor.calibration import Calibration, DecodeDurations, TbtTail
from yuebing.conductor.config import ConductorConfig
from yuebing.conductor.learned import LearnedState, configuration
from yuebing.conductor.policy import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
)

ENGINE = {"model": "smollm2:abc", "threads": "1", "machine": "cpu X | 2 cores"}
PARTS = configuration("fp", [("prefill", ENGINE), ("decode", ENGINE)], "linear", "forecast")
RATIOS = [1.2, 1.5, 1.8, 2.0, 2.2, 2.4, 2.6, 2.8, 3.0, 3.2]  # the tail refreshes at 10


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Learners:
    """One Conductor's three learners and what they handed the policy."""

    def __init__(self) -> None:
        self.tails: list[float] = []
        self.durations: list[tuple[float, ...]] = []
        self.predictors: list[Predictors] = []
        self.tail = TbtTail(self.tails.append, initial=1.0)
        self.dur = DecodeDurations(self.durations.append, every=4, configured=(20.0,))
        self.cal = Calibration(Predictors(
            PrefillPredictor(BivariatePolynomial(((1, 0),), (1e-3,))),
            DecodePredictor(BivariatePolynomial(((0, 0),), (0.03,))), TransferPredictor(),
            "test"), "", self.predictors.append)

    def state(self, root: Path, clock: Clock, save_every_s: float = 30.0) -> LearnedState:
        return LearnedState(root, {"tbt_tail": self.tail, "decode_durations": self.dur,
                                   "prefill_scale": self.cal}, save_every_s, clock)

    def learn(self) -> None:
        for r in RATIOS:
            self.tail.observe(r * 0.05, 0.05)
        for s in (4.0, 5.0, 6.0, 7.0):
            self.dur.observe(s)
        for _ in range(5):
            self.cal.observe(1000, 0, 2.0)  # twice the 1 s estimate


def test_a_fresh_conductor_on_the_same_configuration_starts_from_what_was_learned(
        tmp_path: Path) -> None:
    a, clock = Learners(), Clock()
    state = a.state(tmp_path, clock)
    state.switch(PARTS)
    a.learn()
    assert a.tail.current > 2.0 and a.dur.current and a.cal.scale > 1.5
    state.note()
    state.close()
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # no temporary file left

    b = Learners()
    assert b.tail.current == 1.0 and b.dur.current is None and b.cal.scale == 1.0
    fresh = b.state(tmp_path, Clock())
    fresh.switch(dict(PARTS))
    assert b.tail.current == a.tail.current and b.tails == [a.tail.current]
    assert b.dur.current == a.dur.current and b.durations == [a.dur.current]
    assert b.cal.scale == pytest.approx(a.cal.scale)
    assert b.predictors[-1].prefill.predict(1000, 0) == pytest.approx(
        a.cal.predictors.prefill.predict(1000, 0))
    assert "tbt_tail" in fresh.state()["loaded"]  # type: ignore[operator]


def test_another_configuration_has_its_own_file_and_starts_afresh(tmp_path: Path) -> None:
    a, clock = Learners(), Clock()
    state = a.state(tmp_path, clock)
    state.switch(PARTS)
    a.learn()
    state.note()
    two_prefills = configuration("fp", [("prefill", ENGINE), ("prefill", ENGINE),
                                        ("decode", ENGINE)], "linear", "forecast")
    state.switch(two_prefills)  # the old one is kept, the learners forget it
    state.wait()
    assert a.tail.current == 1.0 and a.dur.current is None and a.cal.scale == 1.0
    assert a.tails[-1] == 1.0 and a.durations[-1] == (20.0,)
    assert len(list(tmp_path.glob("*.json"))) == 1
    state.switch(PARTS)  # back: resumed
    assert a.tail.current > 2.0


def test_switching_back_resumes_what_this_process_learned_even_without_files(
        tmp_path: Path) -> None:
    a = Learners()
    state = LearnedState(None, {"tbt_tail": a.tail, "decode_durations": a.dur}, 30.0)
    state.switch(PARTS)
    a.learn()
    learned = (a.tail.current, a.dur.current)
    other = configuration("fp", [("prefill", ENGINE)] * 2 + [("decode", ENGINE)], "linear",
                          "forecast")
    state.switch(other)  # an instance joined
    assert (a.tail.current, a.dur.current) == (1.0, None)
    state.switch(PARTS)  # it left again: not blind again
    assert (a.tail.current, a.dur.current) == learned
    assert "tbt_tail" in state.state()["loaded"]  # type: ignore[operator]


def _closed(tmp_path: Path) -> tuple[Learners, LearnedState]:
    """Learners that learned on `PARTS`, and their state, written and closed."""
    a = Learners()
    state = a.state(tmp_path, Clock())
    state.switch(PARTS)
    a.learn()
    state.note()
    state.close()
    return a, state


def _kept_file(tmp_path: Path) -> Path:
    path = _closed(tmp_path)[1].path
    assert path is not None
    return path


def test_a_file_that_records_another_configuration_is_refused_and_relearned(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _kept_file(tmp_path)
    doc = json.loads(path.read_text())
    doc["parts"]["instances"] = ["decode: threads=2", "prefill: threads=2"]  # copied by hand
    path.write_text(json.dumps(doc))
    b = Learners()
    with caplog.at_level(logging.WARNING):
        b.state(tmp_path, Clock()).switch(PARTS)
    assert b.tail.current == 1.0 and b.tails == [] and b.cal.scale == 1.0
    assert "refused: it was learned on another configuration (instances:" in caplog.text
    assert "threads=2" in caplog.text and str(path) in caplog.text


@pytest.mark.parametrize("damage", [
    lambda doc: "{not json",
    lambda doc: json.dumps([1, 2]),
    lambda doc: json.dumps({**doc, "learned": {**doc["learned"],
                                               "tbt_tail": {"ratios": [1.5, 9.0]}}}),
    lambda doc: json.dumps({**doc, "learned": {**doc["learned"],
                                               "prefill_scale": {"scale": "2"}}}),
    lambda doc: json.dumps({**doc, "learned": {**doc["learned"],
                                               "decode_durations": {"seconds": [-1.0]}}}),
])
def test_a_corrupt_file_is_refused_with_nothing_of_it_used(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, damage) -> None:
    path = _kept_file(tmp_path)
    path.write_text(damage(json.loads(path.read_text())))
    b = Learners()
    state = b.state(tmp_path, Clock())
    with caplog.at_level(logging.WARNING):
        state.switch(PARTS)
    assert "refused: corrupt" in caplog.text and str(path) in caplog.text
    assert (b.tail.current, b.dur.current, b.cal.scale) == (1.0, None, 1.0)
    assert state.state()["loaded"] is None
    b.learn()  # relearned, and the file replaced by what was
    state.note()
    state.close()
    assert json.loads(path.read_text())["learned"]["tbt_tail"]["ratios"] == pytest.approx(RATIOS)


def test_a_file_that_is_not_text_is_refused(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    path = _kept_file(tmp_path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    b = Learners()
    with caplog.at_level(logging.WARNING):
        b.state(tmp_path, Clock()).switch(PARTS)  # a warning, not an exception
    assert "refused: unreadable" in caplog.text and str(path) in caplog.text
    assert (b.tail.current, b.dur.current, b.cal.scale) == (1.0, None, 1.0)


def test_writes_are_capped_and_the_rest_kept_at_shutdown(tmp_path: Path) -> None:
    a, clock = Learners(), Clock()
    state = a.state(tmp_path, clock, save_every_s=30.0)
    state.switch(PARTS)
    for _ in range(29):
        a.tail.observe(0.1, 0.05)
        state.note()
        clock.t += 1.0
    state.wait()
    assert state.saves == 0
    clock.t += 1.0
    state.note()  # 30 s after the switch
    state.wait()
    assert state.saves == 1
    a.tail.observe(0.1, 0.05)
    state.note()
    state.close()  # waits for its write
    assert state.saves == 2
    assert state.path is not None
    assert len(json.loads(state.path.read_text())["learned"]["tbt_tail"]["ratios"]) == 30


def test_nothing_is_kept_when_persistence_is_off(tmp_path: Path) -> None:
    a = Learners()
    state = LearnedState(None, {"tbt_tail": a.tail}, 30.0)
    state.switch(PARTS)
    a.learn()
    state.note()
    state.close()
    assert state.saves == 0 and state.state()["file"] is None


@pytest.mark.parametrize("kw, says", [
    ({"learned_save_s": 0.0}, "--learned-save-s must be a positive number"),
    ({"learned_save_s": math.nan}, "--learned-save-s must be a positive number"),
])
def test_bad_learned_flags_are_refused(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ConductorConfig(**kw)


def test_a_learned_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("")
    with pytest.raises(ValueError, match="--learned-dir .* is not a directory"):
        ConductorConfig(learned_dir=str(f))
    assert ConductorConfig(learned_dir=str(tmp_path / "new")).learned_dir  # made when written


def test_nothing_is_switched_or_written_after_close(tmp_path: Path) -> None:
    """Instances that leave while the Conductor stops change nothing kept."""
    a, state = _closed(tmp_path)
    kept = state.path.read_text() if state.path else ""
    state.switch(configuration("fp", [("prefill", ENGINE)], "linear", "forecast"))
    state.note()
    state.close()
    assert a.tail.current > 2.0 and state.path is not None and state.path.read_text() == kept
