"""`RequestResult`: what happened to one request of a bench run, and its latency metrics.

Life cycle: `yuebing.bench.client.send` creates one per request; its `StreamReader` appends a
timestamp for each streamed chunk that carries output and fills in the status, usage and error;
`send` calls `finish`, which derives TTFT, TBT (the paper's definition,
`yuebing.trace.latency.tbt_summary`, the code the simulator uses), the P90 and mean
inter-token latency and the end-to-end time.
`yuebing.bench.metrics` aggregates them; `to_json` is one line of ``--records``.

Times are seconds on the run's monotonic clock (0 = the run's start). TTFT and end-to-end
time count from the first attempt's send, so a request resent after a 429 pays its wait.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from yuebing.trace.latency import tbt_summary


class Status(StrEnum):
    OK = "ok"
    """Streamed to the end with at least one token (counted by the usage, the token ids or
    the output chunks)."""
    REJECTED = "rejected"
    """Refused with HTTP 429 (not resent, or resent until its timeout ran out)."""
    ERROR = "error"
    """Anything else; `RequestResult.error` names the kind."""


@dataclass(slots=True)
class RequestResult:
    """One request's outcome; latency fields are NaN until `finish` (and for failures)."""

    index: int
    scheduled_s: float
    input_tokens: int
    max_tokens: int
    start_s: float = math.nan
    """When the first attempt was sent (late sends show as start_s > scheduled_s)."""
    status: Status = Status.ERROR
    http_status: int = 0
    error: str = ""
    """Error kind: connect, timeout, http_<code>, stream_error, incomplete, bad_response,
    no_tokens."""
    detail: str = ""
    retries: int = 0
    """429s answered by waiting Retry-After and resending (``--retry-429``)."""
    token_times_s: list[float] = field(default_factory=list)
    end_s: float = math.nan
    output_tokens: int = 0
    """The usage's completion_tokens, else the token ids streamed, else the number of output
    chunks."""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens`` when the server reports it."""
    ttft_s: float = math.nan
    tbt_s: float = math.nan
    itl_p90_s: float = math.nan
    itl_mean_s: float = math.nan
    e2e_s: float = math.nan

    def fail(self, status: Status, error: str, detail: str = "") -> None:
        """Record a failure (the first one wins: a later cleanup error keeps the cause)."""
        if self.status is Status.ERROR and self.error:
            return
        self.status, self.error, self.detail = status, error, detail[:200]

    def finish(self, end_s: float) -> None:
        """Derive the latency metrics from the token times; called once per request."""
        self.end_s = end_s
        if self.status is not Status.OK:
            return
        times = np.asarray(self.token_times_s, dtype=float)
        self.ttft_s = float(times[0] - self.start_s)
        self.tbt_s, self.itl_p90_s, self.itl_mean_s = tbt_summary(np.diff(times))
        self.e2e_s = end_s - self.start_s

    def meets(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        """Served within both SLOs (a rejected or failed request never is)."""
        return (self.status is Status.OK and self.ttft_s <= ttft_slo_s
                and self.tbt_s <= tbt_slo_s)

    def to_json(self) -> dict[str, Any]:
        """The record as JSON-ready builtins (NaN → None), token times left out."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            if name == "token_times_s":
                continue
            v = getattr(self, name)
            out[name] = None if isinstance(v, float) and not math.isfinite(v) else (
                str(v) if isinstance(v, Status) else v)
        out["chunks"] = len(self.token_times_s)
        return out
