"""Latency metrics of a replayed trace, shared by the simulator and the live load generator.

`yuebing.sim.metrics` (simulated token times) and `yuebing.bench.metrics` (token times measured
on a real endpoint) both import these, so a simulated and a live run are judged by one
definition (pinned by tests/sim/test_metrics.py):

- TBT (the paper's definition) = mean of the longest ``ceil(10 %)`` of a request's token
  intervals; we also keep their P90 and plain mean. A request with one output token has no
  interval and TBT 0.
- The paper's SLO thresholds: TTFT 30 s, TBT 100/200/300 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

TTFT_SLO_S = 30.0
"""Paper §5: TTFT threshold of the effective request capacity."""
TBT_THRESHOLDS_S = (0.1, 0.2, 0.3)
"""Paper Figure 1: TBT thresholds 100/200/300 ms."""


def tbt_summary(intervals: Sequence[float] | np.ndarray) -> tuple[float, float, float]:
    """(mean of the longest ceil(10 %) intervals, P90, mean); all 0 for no intervals.

    P90 is the linearly interpolated 90th percentile (numpy's default method).
    """
    x = np.sort(np.asarray(intervals, dtype=float))
    n = x.size
    if n == 0:
        return 0.0, 0.0, 0.0
    k = math.ceil(n / 10)
    pos = 0.9 * (n - 1)
    lo = int(pos)
    hi = min(lo + 1, n - 1)
    p90 = float(x[lo] + (x[hi] - x[lo]) * (pos - lo))
    return float(x[n - k:].mean()), p90, float(x.mean())


def latency_stats(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """{"mean", "p50", "p90", "p99"} of ``values`` (numpy's interpolated percentiles); all NaN
    for no values."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q ≤ 1) of the finite ``values``: the smallest
    value with at least ``q`` of them at or below it; NaN for none."""
    x = sorted(v for v in values if v is not None and math.isfinite(v))
    if not x:
        return math.nan
    return x[min(len(x) - 1, max(0, math.ceil(q * len(x)) - 1))]
