"""Requests as the simulator replays them.

Life cycle: `load_requests` reads a Mooncake trace once through the trace toolkit
(`yuebing.trace.load_trace`, which validates every line and names file, line and field on
error), takes the requests in timestamp order (stable), applies the replay speed and an
optional window, and returns immutable `SimRequest`s; the runner feeds them to the simulated
system one arrival event at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yuebing.core.errors import InputError
from yuebing.trace.io import load_trace
from yuebing.trace.model import Request


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the replayed trace."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]
    """Chained prefix-block keys (trace ``hash_ids``), one per 512 tokens (last may be partial)."""


def from_trace_requests(reqs: list[Request], speed: float = 1.0) -> list[SimRequest]:
    """Trace requests (already in time order) → `SimRequest`s, first arrival at 0 s.

    Requests with an empty prompt or no output cannot be served and raise `InputError`.
    """
    if not speed > 0:
        raise InputError(f"replay speed must be > 0, got {speed!r}")
    if not reqs:
        raise InputError("no requests to replay")
    t0 = reqs[0].timestamp
    out = []
    for k, r in enumerate(reqs):
        if r.input_length <= 0 or r.output_length <= 0:
            raise InputError(f"request {k} (timestamp {r.timestamp}): input_length and "
                             f"output_length must be > 0 to simulate, got {r.input_length}, "
                             f"{r.output_length}")
        out.append(SimRequest(k, (r.timestamp - t0) / 1000.0 / speed, r.input_length,
                              r.output_length, tuple(r.hash_ids)))
    return out


def load_requests(path: str | Path, speed: float = 1.0, limit: int | None = None,
                  start: int = 0) -> list[SimRequest]:
    """Trace requests ``[start, start+limit)`` in arrival order, timestamps divided by ``speed``.

    Arrival times are shifted so the first selected request arrives at 0 s.
    """
    if start < 0 or (limit is not None and limit <= 0):
        raise InputError(f"start must be >= 0 and limit > 0 (got start={start}, limit={limit})")
    ordered = load_trace(path).in_time_order()
    stop = len(ordered) if limit is None else min(len(ordered), start + limit)
    chosen = ordered[start:stop]
    if not chosen:
        raise InputError(f"{path}: no requests selected (start={start}, limit={limit})")
    return from_trace_requests(chosen, speed)
