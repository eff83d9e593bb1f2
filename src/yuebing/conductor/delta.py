"""`Delta`: what one instance event adds to a response, and `delta`, which makes it.

`delta(event, stats, received)` is called for every token event a request relays, by
`yuebing.conductor.dispatch.Dispatcher._relay` (events it reads from the queue) and by the
fast path's sink (`yuebing.conductor.push.token_sink`); it also records the tokens' times,
count and finish in the request's `RequestStats`.
"""

from __future__ import annotations

from dataclasses import dataclass

from yuebing.conductor.stats import RequestStats
from yuebing.protocol.instance import EventKind, TaskEvent

_FINISH = {"stop": "stop", "eos": "stop", "stop_string": "stop", "length": "length",
           "max_tokens": "length"}
"""An instance's finish reason → OpenAI's (``stop`` for anything unknown)."""


@dataclass(frozen=True, slots=True)
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    received_s: float = 0.0
    """``time.perf_counter()`` when the event's frame arrived from the instance."""


def delta(ev: TaskEvent, stats: RequestStats, received: float) -> Delta:
    """The `Delta` of ``ev`` (its frame read at ``received``), recorded in ``stats``: token
    times shifted to the Conductor's clock by the event's own spacing, the completion count,
    and the finish."""
    now = received
    n = len(ev.token_ids)
    if stats.first_token_s is None and n:
        stats.first_token_s = now
    if n and len(ev.token_times) == n:
        last = ev.token_times[-1]
        stats.token_times.extend(now - (last - t) for t in ev.token_times)
    else:
        stats.token_times.extend([now] * n)
    stats.completion_tokens += n
    reason = None
    if ev.kind == EventKind.FINISH or ev.finish_reason:
        reason = _FINISH.get(ev.finish_reason or "stop", "stop")
        stats.finish_reason = reason
        stats.end_s = now
    return Delta(list(ev.token_ids), ev.text, reason, received)
