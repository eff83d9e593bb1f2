"""Aggregates of a bench run: SLO attainment, goodput, latency percentiles, errors by kind;
called by `bench.runner` after each run (one per rate of a sweep) on its `RequestResult`s.

*Attainment* at (TTFT x, TBT y) = requests served within both / all sent (`attainment`: the
paper's effective request capacity, as `sim.metrics.effective_capacity`); *goodput* = requests
and tokens meeting the first thresholds per second of the run (`run_span_s`: first send to last
answer); ``send_lag_s`` shows a late client; `max_sustained_rate` is a sweep's largest rate
reaching the target attainment.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from yuebing.bench.config import BenchConfig
from yuebing.bench.result import RequestResult, Status
from yuebing.trace.latency import latency_stats


def attainment(results: Sequence[RequestResult], ttft_s: float, tbt_s: float) -> float:
    """Share of ``results`` served within TTFT ≤ ``ttft_s`` and TBT ≤ ``tbt_s``."""
    if not results:
        return 0.0
    return sum(1 for r in results if r.meets(ttft_s, tbt_s)) / len(results)


def run_span_s(results: Sequence[RequestResult]) -> float:
    """First send to last answer, seconds (0 for no request)."""
    starts = [r.start_s for r in results if math.isfinite(r.start_s)]
    ends = [r.end_s for r in results if math.isfinite(r.end_s)]
    return max(ends) - min(starts) if starts and ends else 0.0


def _slo_table(results: Sequence[RequestResult], cfg: BenchConfig,
               span_s: float) -> list[dict[str, float]]:
    rows = []
    for x in cfg.slo_ttft:
        for y in cfg.slo_tbt:
            good = [r for r in results if r.meets(x, y)]
            rows.append({
                "ttft_s": x, "tbt_s": y,
                "attainment": len(good) / len(results) if results else 0.0,
                "goodput_rps": len(good) / span_s if span_s else 0.0,
                "goodput_tokens_per_s": sum(r.output_tokens for r in good) / span_s
                if span_s else 0.0})
    return rows


def _token_totals(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.status is Status.OK]
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt_of_reported = sum(r.prompt_tokens or r.input_tokens for r in reported)
    return {
        "input_sent": sum(r.input_tokens for r in results),
        "prompt": sum(r.prompt_tokens or r.input_tokens for r in ok),
        "output": sum(r.output_tokens for r in ok),
        "cached": sum(r.cached_tokens or 0 for r in reported) if reported else None,
        "cached_share": (sum(r.cached_tokens or 0 for r in reported) / prompt_of_reported
                         if prompt_of_reported else None),
        "cached_reported_by": len(reported),
    }


def summarize(results: Sequence[RequestResult], cfg: BenchConfig) -> dict[str, Any]:
    """The run's aggregates (JSON-ready; a value that does not exist is NaN or None).

    ``capacity`` maps each TBT threshold in ms to the attainment at the first TTFT threshold (the
    simulator's layout); throughput counts every completed request, goodput only those meeting the
    first TTFT and TBT thresholds."""
    span = run_span_s(results)
    ok = [r for r in results if r.status is Status.OK]
    slo = _slo_table(results, cfg, span)
    first_ttft = cfg.slo_ttft[0]
    lags = [r.start_s - r.scheduled_s for r in results if math.isfinite(r.start_s)]
    return {
        "requests": len(results),
        "completed": len(ok),
        "rejected": sum(1 for r in results if r.status is Status.REJECTED),
        "errors": sum(1 for r in results if r.status is Status.ERROR),
        "errors_by_kind": dict(sorted(Counter(
            r.error for r in results if r.status is Status.ERROR).items())),
        "retries_429": sum(r.retries for r in results),
        "duration_s": span,
        "throughput_rps": len(ok) / span if span else 0.0,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / span if span else 0.0,
        "attainment": slo[0]["attainment"],
        "goodput_rps": slo[0]["goodput_rps"],
        "goodput_tokens_per_s": slo[0]["goodput_tokens_per_s"],
        "slo": slo,
        "capacity": {str(round(y * 1000)): attainment(results, first_ttft, y)
                     for y in cfg.slo_tbt},
        "ttft_s": latency_stats([r.ttft_s for r in ok]),
        "tbt_s": latency_stats([r.tbt_s for r in ok]),
        "itl_p90_s": latency_stats([r.itl_p90_s for r in ok]),
        "itl_mean_s": latency_stats([r.itl_mean_s for r in ok]),
        "e2e_s": latency_stats([r.e2e_s for r in ok]),
        "tokens": _token_totals(results),
        "send_lag_s": {"mean": sum(lags) / len(lags), "max": max(lags)} if lags else None,
    }


def max_sustained_rate(sweep: Sequence[tuple[float, dict[str, Any]]],
                       target: float) -> float | None:
    """The largest rate whose summary's attainment is ≥ ``target``; None when none is."""
    good = [rate for rate, summary in sweep if summary["attainment"] >= target]
    return max(good) if good else None
