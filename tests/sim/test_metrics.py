"""Metric definitions: TBT = mean of the longest ceil(10 %) intervals; effective capacity."""

from __future__ import annotations

import math

import pytest

from yuebing.conductor.policy.types import RejectStage
from yuebing.sim.metrics import (
    RequestRecord,
    capacity_curve,
    effective_capacity,
    learned_tail,
    summarize,
    tbt_summary,
)


def test_tbt_is_mean_of_longest_tenth() -> None:
    # 10 intervals: ceil(1.0) = 1 longest -> 1.0; P90 at position 8.1 -> 0.1 + 0.9 * 0.1
    tbt, p90, mean = tbt_summary([0.1] * 9 + [1.0])
    assert tbt == 1.0
    assert p90 == pytest.approx(0.19)
    assert mean == pytest.approx(0.19)


def test_tbt_rounds_the_tenth_up() -> None:
    # 11 intervals: ceil(1.1) = 2 longest -> (0.5 + 0.3) / 2
    tbt, _, _ = tbt_summary([0.1] * 9 + [0.3, 0.5])
    assert tbt == pytest.approx(0.4)
    # 1 interval: it is its own longest tenth
    assert tbt_summary([0.25]) == (0.25, 0.25, 0.25)


def test_no_interval_means_zero_tbt() -> None:
    assert tbt_summary([]) == (0.0, 0.0, 0.0)


def _rec(i: int, ttft: float, tbt: float, rejected: RejectStage | None = None) -> RequestRecord:
    r = RequestRecord(index=i, arrival_s=10.0, input_tokens=100, output_tokens=2)
    if rejected is not None:
        r.rejected, r.reject_reason = rejected, "test"
        return r
    r.prefill_start_s = 10.0
    r.first_token_s = 10.0 + ttft
    r.kv_ready_s = r.decode_start_s = r.first_token_s
    r.finish_decode([r.first_token_s, r.first_token_s + tbt])
    return r


def test_finish_decode_computes_tbt_from_token_times() -> None:
    r = RequestRecord(index=0, arrival_s=0.0, input_tokens=10, output_tokens=4)
    r.finish_decode([1.0, 1.1, 1.3, 1.6])
    assert r.finish_s == 1.6
    assert r.tbt_s == pytest.approx(0.3)
    assert r.tbt_mean_s == pytest.approx(0.2)


def test_effective_capacity_counts_rejections_as_misses() -> None:
    records = [
        _rec(0, ttft=1.0, tbt=0.05),      # meets 100/200/300
        _rec(1, ttft=29.9, tbt=0.15),     # meets 200/300
        _rec(2, ttft=30.1, tbt=0.05),     # TTFT miss
        _rec(3, ttft=1.0, tbt=0.25),      # meets 300
        _rec(4, ttft=0, tbt=0, rejected=RejectStage.ARRIVAL),
    ]
    assert effective_capacity(records, 0.1) == pytest.approx(1 / 5)
    assert effective_capacity(records, 0.2) == pytest.approx(2 / 5)
    assert effective_capacity(records, 0.3) == pytest.approx(3 / 5)
    assert capacity_curve(records, [0.1, 0.3]) == [(0.1, pytest.approx(0.2)),
                                                   (0.3, pytest.approx(0.6))]
    assert effective_capacity([], 0.1) == 0.0


def test_summary_counts_and_breakdown() -> None:
    records = [_rec(0, 2.0, 0.05), _rec(1, 4.0, 0.05),
               _rec(2, 0, 0, rejected=RejectStage.DECODE)]
    records[0].hit_tokens = 50
    s = summarize(records)
    assert s["requests"] == 3 and s["completed"] == 2 and s["rejected"] == 1
    assert s["rejected_by_stage"] == {"decode": 1}
    assert s["ttft_s"]["mean"] == pytest.approx(3.0)  # type: ignore[index]
    assert s["hit_rate"] == pytest.approx(50 / 200)
    assert s["effective_capacity"] == {"100": pytest.approx(2 / 3), "200": pytest.approx(2 / 3),
                                       "300": pytest.approx(2 / 3)}
    assert s["breakdown_mean_s"]["prefill_s"] == pytest.approx(3.0)  # type: ignore[index]
    assert math.isclose(s["breakdown_mean_s"]["queue_s"], 0.0)  # type: ignore[index]


def test_learned_tail_is_the_conductors_quantile_over_the_last_busy_requests() -> None:
    """`learned_tail`: the 0.9 quantile (nearest rank) of paper TBT / step over the last 32
    finished requests routed while a prefill node had work, each ratio within [1, 4]; 1.0
    below the Conductor's 10 samples."""
    def rec(i: int, ratio: float, busy: bool = True) -> RequestRecord:
        r = RequestRecord(index=i, arrival_s=float(i), input_tokens=10, output_tokens=10)
        r.finish_s, r.tbt_s, r.step_mean_s, r.prefill_busy = 100.0 + i, 0.02 * ratio, 0.02, busy
        return r

    assert learned_tail([rec(i, 2.0) for i in range(9)]) == 1.0  # too few to learn
    ten = [rec(i, 1.0 + i / 10) for i in range(10)]
    assert learned_tail(ten) == pytest.approx(1.8)  # the 9th of 10, not the largest (1.9)
    idle = [rec(100 + i, 3.0, busy=False) for i in range(20)]  # not counted
    assert learned_tail(ten + idle) == pytest.approx(1.8)
    old = [rec(i - 100, 3.9) for i in range(40)]  # finished before the last 32
    assert learned_tail(old + [rec(i, 1.5) for i in range(32)]) == pytest.approx(1.5)
    assert learned_tail([rec(i, 9.0) for i in range(10)]) == 4.0  # within TAIL_LIMITS
    assert learned_tail([rec(i, 0.5) for i in range(10)]) == 1.0
