"""Summary statistics of a trace (`yuebing trace stats`).

Definitions (pinned by tests):
- percentiles use numpy's default linear interpolation;
- ``duration_s`` = (latest − earliest timestamp) / 1000;
- ``arrival_rate_per_s`` = requests / duration_s (``None`` when the duration is 0);
- ``cache_ratio`` = share of all prompt blocks whose id was already seen in an earlier request,
  walking requests in timestamp order (stable) — the hit rate of an unbounded block cache,
  counted in blocks;
- ``out_of_order`` = lines whose timestamp is smaller than the line before (allowed, reported).
"""

from __future__ import annotations

import msgspec
import numpy as np

from yuebing.trace.model import Trace


class LengthStats(msgspec.Struct, frozen=True):
    """Distribution of one length column."""

    mean: float
    p50: float
    p90: float
    p99: float
    min: int
    max: int
    total: int


class TraceStats(msgspec.Struct, frozen=True):
    """What `trace_stats` reports."""

    requests: int
    input: LengthStats
    output: LengthStats
    duration_s: float
    arrival_rate_per_s: float | None
    blocks: int
    unique_blocks: int
    cache_ratio: float
    out_of_order: int
    block_size: int


def _lengths(values: np.ndarray) -> LengthStats:
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return LengthStats(
        mean=float(values.mean()), p50=float(p50), p90=float(p90), p99=float(p99),
        min=int(values.min()), max=int(values.max()), total=int(values.sum()))


def cache_ratio(trace: Trace) -> tuple[float, int, int]:
    """(share of blocks seen before, total blocks, unique blocks), in timestamp order."""
    seen: set[int] = set()
    total = repeated = 0
    for r in trace.in_time_order():
        for h in r.hash_ids:
            if h in seen:
                repeated += 1
            else:
                seen.add(h)
        total += len(r.hash_ids)
    return (repeated / total if total else 0.0), total, len(seen)


def trace_stats(trace: Trace) -> TraceStats:
    """Statistics of a non-empty trace."""
    if not trace.requests:
        raise ValueError("cannot compute statistics of an empty trace")
    ts = np.fromiter((r.timestamp for r in trace.requests), dtype=np.int64,
                     count=len(trace.requests))
    inputs = np.fromiter((r.input_length for r in trace.requests), dtype=np.int64,
                         count=len(trace.requests))
    outputs = np.fromiter((r.output_length for r in trace.requests), dtype=np.int64,
                          count=len(trace.requests))
    duration_s = float(ts.max() - ts.min()) / 1000.0
    ratio, blocks, unique = cache_ratio(trace)
    return TraceStats(
        requests=len(trace.requests),
        input=_lengths(inputs),
        output=_lengths(outputs),
        duration_s=duration_s,
        arrival_rate_per_s=(len(trace.requests) / duration_s) if duration_s > 0 else None,
        blocks=blocks,
        unique_blocks=unique,
        cache_ratio=ratio,
        out_of_order=int((np.diff(ts) < 0).sum()),
        block_size=trace.block_size,
    )
