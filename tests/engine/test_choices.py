"""`engine.choices`: the first process measures, the next reads; a changed key or a bad file
measures again, and an unusable cache still gives a choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yuebing.core import choices as core_choices
from yuebing.engine import choices as engine_choices
from yuebing.engine.choices import attention_choice, routes_choice, shared_choice

PARTS = {"machine": "m", "decodes": ["a", "b"], "prefills": ["c", "d"]}


def test_the_first_measures_and_the_next_reads(tmp_path: Path) -> None:
    calls: list[int] = []

    def measure(pick: str = "b"):  # type: ignore[no-untyped-def]
        calls.append(1)
        return pick, "d", {"decode_b": 0.5}

    assert shared_choice(PARTS, measure, attention_choice, tmp_path) == (("b", "d", {"decode_b": 0.5}), False)
    # a second process on a loaded machine would have measured "a": it reads "b" instead
    assert shared_choice(PARTS, lambda: measure("a"), attention_choice, tmp_path) == \
        (("b", "d", {"decode_b": 0.5}), True)
    assert len(calls) == 1
    assert shared_choice({**PARTS, "machine": "other"}, lambda: measure("a"), attention_choice,
                         tmp_path)[1] \
        is False


def test_a_bad_file_or_an_unusable_cache_measures(tmp_path: Path) -> None:
    shared_choice(PARTS, lambda: ("a", "c", {}), attention_choice, tmp_path)
    for f in tmp_path.glob("*.json"):
        f.write_text("{not json")
    assert shared_choice(PARTS, lambda: ("b", "d", {}), attention_choice, tmp_path) == (("b", "d", {}), False)
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert shared_choice(PARTS, lambda: ("a", "d", {}), attention_choice, blocker / "sub") == \
        (("a", "d", {}), False)


def test_a_kept_route_choice_round_trips_and_a_malformed_one_is_refused() -> None:
    assert routes_choice([{"576x1536": [512]}, {"576x1536@512_mm": 1}]) == \
        ({"576x1536": [512]}, {"576x1536@512_mm": 1.0})
    for bad in ([{"576x1536": 512}, {}], [{"576x1536": ["512"]}, {}], [[], {}]):
        with pytest.raises(TypeError, match="matmul route"):
            routes_choice(bad)


def test_the_key_names_the_machine_and_the_choice_set_version(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    shared_choice(PARTS, lambda: ("a", "c", {}), attention_choice, tmp_path)
    (kept,) = tmp_path.glob("*.json")
    parts = json.loads(kept.read_text())["parts"]
    assert {k: parts[k] for k in ("cpu", "cpus")} == core_choices.machine_parts()
    assert parts["engine_choices"] == engine_choices.VERSION
    monkeypatch.setattr(engine_choices, "VERSION", engine_choices.VERSION + 1)
    assert shared_choice(PARTS, lambda: ("b", "d", {}), attention_choice, tmp_path) == \
        (("b", "d", {}), False)  # a new choice set measures again
