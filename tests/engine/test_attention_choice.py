"""`choose_attention`'s timing: candidates interleaved round by round, the median kept."""

from __future__ import annotations

import torch

from yuebing.engine.attention import choose_attention
from yuebing.engine.choices import interleaved_times


def test_candidates_are_interleaved_and_the_median_is_kept(monkeypatch) -> None:
    """A fake clock: each call of a candidate advances it by that candidate's scripted cost.
    "a" is fast except for one disturbed run; it must still be the faster by its median."""
    now = [0.0]
    calls: list[str] = []
    cost = {"a": iter([0.0, 1.0, 9.0, 1.0]), "b": iter([0.0, 2.0, 2.0, 2.0])}

    def make(name: str):  # type: ignore[no-untyped-def]
        def fn() -> None:
            calls.append(name)
            now[0] += next(cost[name])
        return fn
    monkeypatch.setattr("yuebing.engine.choices.time.perf_counter", lambda: now[0])
    times = interleaved_times({"a": make("a"), "b": make("b")}, torch.device("cpu"), 3)
    assert calls == ["a", "b", "a", "b", "a", "b", "a", "b"]  # warm-up, then 3 rounds
    assert times == {"a": 1.0, "b": 2.0}


def test_choice_names_a_measured_path_of_each_kind() -> None:
    decode, prefill, timings = choose_attention(2, 4, 16, torch.float32, torch.device("cpu"),
                                                batch=2, context=64, repeats=3)
    assert f"decode_{decode}" in timings and f"prefill_{prefill}" in timings
    assert timings[f"decode_{decode}"] == min(v for k, v in timings.items()
                                              if k.startswith("decode_"))
