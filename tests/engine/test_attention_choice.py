"""`choose_attention`'s timing: candidates interleaved round by round (the order reversed every
other round), the median kept; `paired_ratios` round by round."""

from __future__ import annotations

import torch

from yuebing.engine.attention import choose_attention
from yuebing.engine.choices import interleaved_samples, interleaved_times, paired_ratios


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
    # warm-up, then 3 rounds: the second in reverse, so neither always runs first
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert times == {"a": 1.0, "b": 2.0}


def test_paired_ratios_compare_within_each_round(monkeypatch) -> None:
    """The host runs at half speed in round 2: both sides of that round's ratio slow alike."""
    now = [0.0]
    slow = {"rounds": 0}
    cost = {"a": 1.0, "b": 2.0}

    def make(name: str):  # type: ignore[no-untyped-def]
        def fn() -> None:
            now[0] += cost[name] * (2.0 if slow["rounds"] in (4, 5) else 1.0)
            slow["rounds"] += 1
        return fn
    monkeypatch.setattr("yuebing.engine.choices.time.perf_counter", lambda: now[0])
    samples = interleaved_samples({"a": make("a"), "b": make("b")}, torch.device("cpu"), 3)
    assert samples == {"a": [1.0, 2.0, 1.0], "b": [2.0, 4.0, 2.0]}
    assert paired_ratios(samples, "a", "b") == [0.5, 0.5, 0.5]
    assert paired_ratios({"a": [1.0, 3.0], "b": [0.0, 2.0]}, "a", "b") == [1.5]


def test_choice_names_a_measured_path_of_each_kind() -> None:
    decode, prefill, timings = choose_attention(2, 4, 16, torch.float32, torch.device("cpu"),
                                                batch=2, context=64, repeats=3)
    assert f"decode_{decode}" in timings and f"prefill_{prefill}" in timings
    assert timings[f"decode_{decode}"] == min(v for k, v in timings.items()
                                              if k.startswith("decode_"))
