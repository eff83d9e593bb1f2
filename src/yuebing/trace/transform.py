"""Trace transforms: time scaling, length scaling, Poisson re-timing, filtering.

Each function takes a `Trace` and returns a new one (traces are immutable); bad parameters raise
`ConfigError` before anything is computed. Timestamps stay whole milliseconds (rounded half to
even). Length scaling keeps prefix sharing consistent: block i of a scaled prompt takes its id
from (original block ⌊i / factor⌋, i), so two requests share a scaled block exactly when they
shared the original block it was cut from — equal ids still mean equal prefixes.
"""

from __future__ import annotations

import math

import numpy as np

from yuebing.core.config import require
from yuebing.trace.model import MAX_TIMESTAMP_MS, MAX_TOKENS, Request, Trace, blocks_needed


def scale_time(trace: Trace, factor: float) -> Trace:
    """Multiply every timestamp by ``factor`` (0.5 replays twice as fast)."""
    require(math.isfinite(factor) and factor > 0,
            f"time factor must be a positive number, got {factor}")
    last = max(r.timestamp for r in trace.requests) * factor if trace.requests else 0.0
    require(last <= MAX_TIMESTAMP_MS, f"time factor {factor:g} puts the last arrival at "
            f"{last:.4g} ms, past the {MAX_TIMESTAMP_MS:.0e} ms a trace may hold")
    out = [Request(round(r.timestamp * factor), r.input_length, r.output_length, r.hash_ids)
           for r in trace.requests]
    return trace.with_requests(out, f"{trace.source} | time×{factor:g}")


class _Interner:
    """Dense ids (0, 1, ...) for keys in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}

    def __call__(self, key: tuple[int, int]) -> int:
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _scaled_ids(hash_ids: tuple[int, ...], new_len: int, factor: float, block_size: int,
                intern: _Interner) -> tuple[int, ...]:
    ids: list[int] = []
    for i in range(blocks_needed(new_len, block_size)):
        j = math.floor(i / factor + 1e-9)
        if j >= len(hash_ids):
            break
        ids.append(intern((hash_ids[j], i)))
    return tuple(ids)


def scale_lengths(trace: Trace, input_factor: float = 1.0, output_factor: float = 1.0) -> Trace:
    """Scale prompt and output lengths (rounded); block ids are re-derived consistently.

    With ``input_factor == 1`` the block ids are kept as they are; otherwise every block id of
    the result is a fresh dense id (see the module docstring for how sharing is preserved).
    """
    for name, f in (("input", input_factor), ("output", output_factor)):
        require(math.isfinite(f) and f > 0, f"{name} length factor must be positive, got {f}")
        longest = max((getattr(r, f"{name}_length") for r in trace.requests), default=0) * f
        require(longest <= MAX_TOKENS, f"{name} length factor {f:g} makes a request of "
                f"{longest:.4g} tokens, past the {MAX_TOKENS:,} a trace may hold")
    intern = _Interner()
    out: list[Request] = []
    for r in trace.requests:
        new_in = round(r.input_length * input_factor)
        ids = r.hash_ids if input_factor == 1.0 else _scaled_ids(
            r.hash_ids, new_in, input_factor, trace.block_size, intern)
        out.append(Request(r.timestamp, new_in, round(r.output_length * output_factor), ids))
    return trace.with_requests(
        out, f"{trace.source} | lengths×({input_factor:g},{output_factor:g})")


def poisson_arrivals(n: int, rate_per_s: float, seed: int) -> list[int]:
    """``n`` arrival times in ms: 0, then exponential gaps of mean 1000/rate (seeded numpy)."""
    require(math.isfinite(rate_per_s) and rate_per_s > 0,
            f"arrival rate must be a positive number of requests/s, got {rate_per_s}")
    require(seed >= 0, f"seed must be >= 0, got {seed}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1000.0 / rate_per_s, size=max(n - 1, 0))
    times = np.concatenate(([0.0], np.cumsum(gaps)))
    require(float(times[-1]) <= MAX_TIMESTAMP_MS, f"arrival rate {rate_per_s:g}/s puts the last "
            f"of {n} arrivals at {float(times[-1]):.4g} ms, past the {MAX_TIMESTAMP_MS:.0e} ms "
            "a trace may hold")
    return [round(float(t)) for t in times[:n]]


def retime_poisson(trace: Trace, rate_per_s: float, seed: int = 0) -> Trace:
    """Keep the requests' order (by timestamp, stable) but give them Poisson arrivals."""
    ordered = trace.in_time_order()
    times = poisson_arrivals(len(ordered), rate_per_s, seed)
    out = [Request(t, r.input_length, r.output_length, r.hash_ids)
           for t, r in zip(times, ordered, strict=True)]
    return trace.with_requests(out, f"{trace.source} | poisson({rate_per_s:g}/s, seed={seed})")


def _within(value: int, low: int | None, high: int | None) -> bool:
    return (low is None or value >= low) and (high is None or value <= high)


def filter_trace(
    trace: Trace, *, start_ms: int | None = None, end_ms: int | None = None,
    min_input: int | None = None, max_input: int | None = None,
    min_output: int | None = None, max_output: int | None = None,
    limit: int | None = None, rebase: bool = False,
) -> Trace:
    """Requests with ``start_ms <= timestamp < end_ms`` and lengths within the inclusive bounds.

    ``limit`` keeps only the first N matches in timestamp order; ``rebase`` shifts timestamps
    so the earliest kept request arrives at 0. The result is in timestamp order.
    """
    require(start_ms is None or end_ms is None or start_ms < end_ms,
            f"empty time window: start {start_ms} ms must be before end {end_ms} ms")
    require(limit is None or limit >= 0, f"limit must be >= 0, got {limit}")
    for lo, hi, name in ((min_input, max_input, "input"), (min_output, max_output, "output")):
        require(lo is None or hi is None or lo <= hi,
                f"min {name} length {lo} is above max {name} length {hi}")
    kept = [r for r in trace.in_time_order()
            if _within(r.timestamp, start_ms, None)
            and (end_ms is None or r.timestamp < end_ms)
            and _within(r.input_length, min_input, max_input)
            and _within(r.output_length, min_output, max_output)]
    if limit is not None:
        kept = kept[:limit]
    if rebase and kept:
        t0 = kept[0].timestamp
        kept = [Request(r.timestamp - t0, r.input_length, r.output_length, r.hash_ids)
                for r in kept]
    return trace.with_requests(kept, f"{trace.source} | filtered")
