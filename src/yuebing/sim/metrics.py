"""Per-request records and aggregate metrics of a simulation.

The runner creates one `RequestRecord` per trace request before its arrival; the simulated
system fills it in as the request moves (routing → prefill → transfer → decode, or rejection)
and calls `finish_decode` with its token times. After the run `summarize` aggregates the
records; `effective_capacity` and `capacity_curve` give the paper's effective request capacity,
`learned_tail` the TBT tail a live Conductor would learn from them
(TBT and latency stats come from `yuebing.trace.latency`, shared with the live bench).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from yuebing.conductor.policy.tail import (
    TAIL_QUANTILE,
    TAIL_WINDOW,
    min_tail_samples,
    tail_ratio,
)
from yuebing.conductor.policy.types import RejectStage
from yuebing.trace.latency import TBT_THRESHOLDS_S, TTFT_SLO_S, nearest_rank, tbt_summary
from yuebing.trace.latency import latency_stats as _stats

__all__ = ["TBT_THRESHOLDS_S", "TTFT_SLO_S", "RequestRecord", "capacity_curve",
           "effective_capacity", "learned_tail", "summarize", "tbt_summary"]


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in simulated seconds since the trace start)."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    prefill_id: str = ""
    decode_id: str = ""
    hit_tokens: int = 0
    """Prompt tokens whose KV was reused (local or fetched) instead of recomputed."""
    fetched_tokens: int = 0
    """Of ``hit_tokens``, those copied from another node's pool."""
    prefill_start_s: float = math.nan
    first_token_s: float = math.nan
    """End of prefill: the first token is out."""
    kv_ready_s: float = math.nan
    """The full KV reached the decode instance."""
    decode_start_s: float = math.nan
    """Admitted into the decode batch."""
    finish_s: float = math.nan
    prefill_gpu_s: float = 0.0
    """GPU-seconds spent on this request's prefill (summed over a pipeline group)."""
    tbt_s: float = math.nan
    tbt_p90_s: float = math.nan
    tbt_mean_s: float = math.nan
    step_mean_s: float = math.nan
    """The time-mean cost-model step of its batch from its second token to its last (without
    slow steps or a neighbour's slowdown): the denominator of the Conductor's TBT tail."""
    prefill_busy: bool = False
    """Routed while a prefill node had work (`Route.prefill_busy`)."""
    rejected: RejectStage | None = None
    reject_reason: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def queue_s(self) -> float:
        """Arrival → prefill start (queueing and waiting for a prefix fetch)."""
        return self.prefill_start_s - self.arrival_s

    @property
    def prefill_s(self) -> float:
        return self.first_token_s - self.prefill_start_s

    @property
    def transfer_s(self) -> float:
        """First token → full KV on the decode instance (the non-overlapped tail)."""
        return self.kv_ready_s - self.first_token_s

    @property
    def decode_wait_s(self) -> float:
        """KV ready → admitted into the decode batch (waiting for HBM)."""
        return self.decode_start_s - self.kv_ready_s

    def meets_slo(self, tbt_threshold_s: float, ttft_slo_s: float = TTFT_SLO_S) -> bool:
        return (self.rejected is None and not math.isnan(self.finish_s)
                and self.ttft_s <= ttft_slo_s and self.tbt_s <= tbt_threshold_s)

    def finish_decode(self, token_times: Sequence[float] | np.ndarray) -> None:
        """Record the times of all output tokens (first token included) and compute TBT."""
        times = np.asarray(token_times, dtype=float)
        if times.size == 0:
            raise ValueError("finish_decode needs at least the first token time")
        self.finish_s = float(times[-1])
        tbt, p90, mean = tbt_summary(np.diff(times))
        self.tbt_s, self.tbt_p90_s, self.tbt_mean_s = tbt, p90, mean


def learned_tail(records: Sequence[RequestRecord], quantile: float = TAIL_QUANTILE,
                 window: int = TAIL_WINDOW) -> float:
    """The TBT tail a live Conductor learns from ``records`` (`yuebing.conductor.calibration.
    TbtTail`): the nearest-rank ``quantile`` of paper TBT / `RequestRecord.step_mean_s`, each
    within `TAIL_LIMITS`, over the last ``window`` requests to finish that were routed while a
    prefill node had work; 1.0 for fewer than the Conductor needs (`TAIL_MIN_SAMPLES`, or
    enough that the quantile is not the largest)."""
    done = sorted((r for r in records if r.rejected is None and r.prefill_busy
                   and math.isfinite(r.finish_s)
                   and tail_ratio(r.tbt_s, r.step_mean_s) is not None),
                  key=lambda r: r.finish_s)[-window:]
    if len(done) < min_tail_samples(quantile, window):
        return 1.0
    ratios = [tail_ratio(r.tbt_s, r.step_mean_s) for r in done]
    return nearest_rank([x for x in ratios if x is not None], quantile)


def effective_capacity(records: Sequence[RequestRecord], tbt_threshold_s: float,
                       ttft_slo_s: float = TTFT_SLO_S) -> float:
    """Share of ``records`` meeting TTFT ≤ ``ttft_slo_s`` and TBT ≤ ``tbt_threshold_s``.

    Definitions (pinned by tests): TTFT = first token − arrival; TBT (the paper's) = mean of the
    longest ``ceil(10 %)`` of the request's token intervals (0 with one output token). A request
    meets the SLO at ``x`` when not rejected, TTFT ≤ ``ttft_slo_s`` (30 s) and TBT ≤ ``x``;
    effective capacity = requests meeting it / all requests (rejected ones count as misses)."""
    if not records:
        return 0.0
    ok = sum(1 for r in records if r.meets_slo(tbt_threshold_s, ttft_slo_s))
    return ok / len(records)


def capacity_curve(records: Sequence[RequestRecord], thresholds_s: Iterable[float],
                   ttft_slo_s: float = TTFT_SLO_S) -> list[tuple[float, float]]:
    """Effective capacity at each TBT threshold: [(threshold_s, share), ...]."""
    return [(t, effective_capacity(records, t, ttft_slo_s)) for t in thresholds_s]


def summarize(records: Sequence[RequestRecord]) -> dict[str, object]:
    """Aggregates of a run: counts, latency stats, breakdown means, hit rate, capacities."""
    done = [r for r in records if r.rejected is None and not math.isnan(r.finish_s)]
    rejected = [r for r in records if r.rejected is not None]
    by_stage: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    for r in rejected:
        assert r.rejected is not None
        stage = r.rejected.name.lower()
        by_stage[stage] = by_stage.get(stage, 0) + 1
        by_reason[r.reject_reason] = by_reason.get(r.reject_reason, 0) + 1
    ttft = np.array([r.ttft_s for r in done])
    tbt = np.array([r.tbt_s for r in done])
    served_input = sum(r.input_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_by_stage": by_stage,
        "rejected_by_reason": by_reason,
        "ttft_s": _stats(ttft),
        "tbt_s": _stats(tbt),
        "breakdown_mean_s": {
            name: float(np.mean([getattr(r, name) for r in done])) if done else math.nan
            for name in ("queue_s", "prefill_s", "transfer_s", "decode_wait_s")},
        "prefill_gpu_s": float(sum(r.prefill_gpu_s for r in records)),
        "hit_rate": (sum(r.hit_tokens for r in done) / served_input) if served_input else 0.0,
        "effective_capacity": {
            str(round(t * 1000)): effective_capacity(records, t) for t in TBT_THRESHOLDS_S},
    }
