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
    """Set when the choice ``index`` ended with this delta."""
    received_s: float = 0.0
    """``time.perf_counter()`` when the event's frame arrived from the instance."""
    index: int = 0
    """The choice (``n > 1``; in a prompt list, offset to the response's numbering)."""
    last: bool = False
    """The request's stream ends here (the instance's FINISH)."""
    logprobs: list[float] | None = None
    """Per token (when asked): its logprob; ``top_ids`` / ``top_logprobs`` the best ones."""
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def delta(ev: TaskEvent, stats: RequestStats, received: float) -> Delta:
    """The `Delta` of ``ev`` (its frame read at ``received``), recorded in ``stats``: token
    times (choice 0's) shifted to the Conductor's clock by the event's own spacing, the
    completion count, and the finish."""
    now = received
    n = len(ev.token_ids)
    if stats.first_token_s is None and n:
        stats.first_token_s = now
    if ev.index == 0:  # TBT follows one stream: other choices' tokens interleave with it
        if n and len(ev.token_times) == n:
            last = ev.token_times[-1]
            stats.token_times.extend(now - (last - t) for t in ev.token_times)
        else:
            stats.token_times.extend([now] * n)
    stats.completion_tokens += n
    reason = None
    last = ev.kind == EventKind.FINISH
    if last or ev.finish_reason:
        reason = _FINISH.get(ev.finish_reason or "stop", "stop")
        stats.finish_reason = reason
    if last:
        stats.end_s = now
    if ev.logprobs and len(ev.logprobs) == n:
        return Delta(list(ev.token_ids), ev.text, reason, received, ev.index, last,
                     list(ev.logprobs), list(ev.top_ids), list(ev.top_logprobs))
    return Delta(list(ev.token_ids), ev.text, reason, received, ev.index, last)
