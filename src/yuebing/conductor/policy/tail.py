"""The TBT tail's definition, shared by the live Conductor (`conductor.calibration.TbtTail`,
which learns it) and the simulator (`sim.metrics.learned_tail`, which reports what a Conductor
would learn from a simulated run): the ratio's quantile, window, sample floor and limits."""

from __future__ import annotations

import math

TAIL_WINDOW = 32
"""Finished requests whose paper TBT per predicted step stand for the tail (the latest ones)."""
TAIL_MIN_SAMPLES = 8
"""Fewest requests the tail is taken from (raised to `outlier_free_samples` of the window)."""
TAIL_LIMITS = (1.0, 4.0)
"""Each ratio is clamped to these before it counts (kept ratios outside them are refused)."""
TAIL_QUANTILE = 0.9
"""The ratio's quantile the tail is: the paper's SLO attainment target."""
MIN_STEP_S = 1e-3
"""Requests predicted a shorter step than this do not count (no prediction to compare with)."""


def outlier_free_samples(quantile: float, most: int) -> int:
    """The fewest samples whose nearest-rank ``quantile`` is not their largest (at most
    ``most``): 10 at 0.9, so one outlier alone never becomes the tail."""
    n = 1
    while n < most and math.ceil(quantile * n) >= n:
        n += 1
    return n


def tail_ratio(tbt_s: float, step_s: float) -> float | None:
    """A finished request's paper TBT per the step predicted for it, clamped to `TAIL_LIMITS`;
    None when it cannot count (no TBT, or no prediction to compare with: `MIN_STEP_S`)."""
    if not (math.isfinite(tbt_s) and tbt_s > 0 and math.isfinite(step_s)
            and step_s >= MIN_STEP_S):
        return None
    lo, hi = TAIL_LIMITS
    return min(max(tbt_s / step_s, lo), hi)


def min_tail_samples(quantile: float, window: int) -> int:
    """Fewest ratios a tail is taken from: `TAIL_MIN_SAMPLES`, and enough that the quantile is
    never the one largest ratio (`outlier_free_samples`)."""
    return max(TAIL_MIN_SAMPLES, outlier_free_samples(quantile, window))
