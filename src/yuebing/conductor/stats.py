"""`RequestStats`: one request's timing and counts as the Conductor saw them.

Created by the HTTP route when a request arrives, filled by the dispatcher (routing, tokens,
the instances' `Breakdown`s) and read at the end by the usage extension of the response
(`extension`), the access log line (`log_line`; `parse_log_line` reads one back, as the
benchmarks do) and the histograms (`ConductorMetrics.finished`).
Times are ``time.perf_counter()`` seconds. TBT is the paper's: the mean of the longest 10 % of
the request's token intervals (`yuebing.trace.latency.tbt_summary`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from yuebing.protocol.instance import Breakdown
from yuebing.trace.latency import tbt_summary


@dataclass
class RequestStats:
    request_id: str
    arrival_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_id: str = ""
    pipelined: bool = False
    """Prefilled by a pipeline group (``prefill_id`` names it): its prefill time is no
    single instance's, so it does not scale the prefill predictor."""
    decode_id: str = ""
    prefix_source: str = ""
    dispatched_s: float | None = None
    """When the prefill (or coupled) task was sent."""
    body_s: float = 0.0
    """When the HTTP body was read; then ``parsed_s`` (validated, tokenized), ``started_s``
    (the dispatcher's first step) and ``decided_s`` (routed): `dispatch_phases`."""
    parsed_s: float = 0.0
    started_s: float = 0.0
    decided_s: float = 0.0
    reserve_s: float = 0.0
    """Round trip of the decode reservation (the decode instance's time, not the Conductor's)."""
    gate_s: float = 0.0
    """Time waiting in the Conductor's queue for the prefill instance (`conductor.gate`)."""
    first_token_s: float | None = None
    token_times: list[float] = field(default_factory=list)
    breakdown: Breakdown = field(default_factory=Breakdown)
    finish_reason: str | None = None
    error_code: str = ""
    redispatched: int = 0
    end_s: float | None = None
    est_ttft_s: float = 0.0
    """The policy's estimate when it routed the request: TTFT = transfer + queue + prefill."""
    est_transfer_s: float = 0.0
    est_queue_s: float = 0.0
    est_prefill_s: float = 0.0
    prefill_busy: bool = False
    """Routed while a prefill instance had work (`Route.prefill_busy`)."""
    prefill_factor: float = 1.0
    """The prefill instance's time factor in ``est_prefill_s`` (`Route.prefill_factor`)."""

    def merge(self, b: Breakdown | None) -> None:
        """Fold an instance's breakdown in (each part is filled by the instance that did it)."""
        if b is None:
            return
        mine = self.breakdown
        self.breakdown = Breakdown(
            queue_s=max(mine.queue_s, b.queue_s),
            prefix_load_s=max(mine.prefix_load_s, b.prefix_load_s),
            prefill_s=max(mine.prefill_s, b.prefill_s),
            transfer_s=max(mine.transfer_s, b.transfer_s),
            decode_wait_s=max(mine.decode_wait_s, b.decode_wait_s),
            kv_bytes=max(mine.kv_bytes, b.kv_bytes),
            streamed_layers=max(mine.streamed_layers, b.streamed_layers),
            layers_before_prefill_end=max(mine.layers_before_prefill_end,
                                          b.layers_before_prefill_end),
            prefill_tokens=max(mine.prefill_tokens, b.prefill_tokens),
            prefill_threads=max(mine.prefill_threads, b.prefill_threads))

    @property
    def queue_s(self) -> float:
        """Queued before the prefill started: in the Conductor's queue and on the instance."""
        return self.gate_s + self.breakdown.queue_s

    @property
    def ttft_s(self) -> float:
        return 0.0 if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tbt_s(self) -> float:
        times = self.token_times
        return tbt_summary([b - a for a, b in zip(times, times[1:], strict=False)])[0]

    @property
    def e2e_s(self) -> float:
        end = self.end_s if self.end_s is not None else (self.token_times or [self.arrival_s])[-1]
        return end - self.arrival_s

    @property
    def dispatch_s(self) -> float:
        """The Conductor's own time from HTTP arrival to the task sent (without the decode
        reservation's round trip and the wait for the prefill instance's turn)."""
        if self.dispatched_s is None:
            return 0.0
        return self.dispatched_s - self.arrival_s - self.reserve_s - self.gate_s

    def dispatch_phases(self) -> dict[str, float]:
        """`dispatch_s` in parts: ``body`` (reading the body), ``parse`` (validating and
        tokenizing), ``start`` (to the dispatcher's task), ``route`` (block keys and the
        policy), ``send`` (the rest: the prefill's turn and the reservation excluded)."""
        if not (self.body_s and self.parsed_s and self.started_s and self.decided_s):
            return {}
        parts = {"body": self.body_s - self.arrival_s, "parse": self.parsed_s - self.body_s,
                 "start": self.started_s - self.parsed_s,
                 "route": self.decided_s - self.started_s}
        parts["send"] = self.dispatch_s - sum(parts.values())
        return parts

    def extension(self) -> dict[str, object]:
        """The ``usage.yuebing`` extension field of the final usage."""
        b = self.breakdown
        return {"ttft_s": round(self.ttft_s, 6), "tbt_s": round(self.tbt_s, 6),
                "queue_s": round(self.queue_s, 6), "prefix_load_s": round(b.prefix_load_s, 6),
                "prefill_s": round(b.prefill_s, 6), "transfer_s": round(b.transfer_s, 6),
                "decode_wait_s": round(b.decode_wait_s, 6),
                "prefill_tokens": b.prefill_tokens,
                "prefill_threads": round(b.prefill_threads, 3),
                "streamed_layers": b.streamed_layers,
                "layers_before_prefill_end": b.layers_before_prefill_end,
                "conductor_s": round(self.dispatch_s, 6), "prefill_instance": self.prefill_id,
                "decode_instance": self.decode_id, "prefix_source": self.prefix_source,
                "redispatched": self.redispatched,
                "estimate": {"ttft_s": round(self.est_ttft_s, 6),
                             "transfer_s": round(self.est_transfer_s, 6),
                             "queue_s": round(self.est_queue_s, 6),
                             "prefill_s": round(self.est_prefill_s, 6),
                             "prefill_factor": round(self.prefill_factor, 4)}}

    def log_line(self, status: int) -> str:
        b = self.breakdown
        return (f"{self.request_id} status={status} prefill={self.prefill_id or '-'} "
                f"decode={self.decode_id or '-'} prompt={self.prompt_tokens} "
                f"cached={self.cached_tokens} out={self.completion_tokens} "
                f"finish={self.finish_reason or self.error_code or '-'} "
                f"ttft={self.ttft_s * 1e3:.1f}ms tbt={self.tbt_s * 1e3:.1f}ms "
                f"queue={self.queue_s * 1e3:.1f}ms prefix_load={b.prefix_load_s * 1e3:.1f}ms "
                f"prefill={b.prefill_s * 1e3:.1f}ms transfer={b.transfer_s * 1e3:.1f}ms "
                f"decode_wait={b.decode_wait_s * 1e3:.1f}ms conductor={self.dispatch_s * 1e3:.2f}ms "
                f"e2e={self.e2e_s * 1e3:.1f}ms est_ttft={self.est_ttft_s * 1e3:.1f}ms "
                f"est_prefill={self.est_prefill_s * 1e3:.1f}ms")


_MS = r"([\d.]+)ms"
_LOG_LINE = re.compile(
    r" status=(?P<status>\d+) prefill=(?P<prefill_id>\S+) decode=(?P<decode_id>\S+) "
    r"prompt=(?P<prompt>\d+) cached=(?P<cached>\d+) out=(?P<out>\d+) finish=\S+ "
    rf"ttft={_MS} tbt={_MS} queue={_MS} prefix_load={_MS} prefill={_MS}"
    rf"(?: transfer={_MS} decode_wait={_MS} conductor={_MS} e2e={_MS})?")
_TIMES = ("ttft", "tbt", "queue", "prefix_load", "prefill", "transfer", "decode_wait",
          "conductor", "e2e")


def parse_log_line(line: str) -> dict[str, str | int | float] | None:
    """The fields of an access line `RequestStats.log_line` wrote (None: not one): ``status``,
    ``prompt``, ``cached``, ``out`` as ints, ``prefill_id`` and ``decode_id``, and the times in
    seconds (``prefill`` is the prefill's time; ``transfer`` … ``e2e`` absent from older lines)."""
    m = _LOG_LINE.search(line)
    if m is None:
        return None
    out: dict[str, str | int | float] = {
        "status": int(m["status"]), "prefill_id": m["prefill_id"], "decode_id": m["decode_id"],
        "prompt": int(m["prompt"]), "cached": int(m["cached"]), "out": int(m["out"])}
    for name, value in zip(_TIMES, m.groups()[6:], strict=True):
        if value is not None:
            out[name] = float(value) / 1e3
    return out
