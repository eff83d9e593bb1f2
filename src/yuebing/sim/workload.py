"""Requests as the simulator replays them.

Life cycle: `load_requests` reads a Mooncake trace once (through `yuebing.trace` when it is
installed, else directly with msgspec), applies the replay speed and an optional limit, and
returns immutable `SimRequest`s sorted by arrival (stable); the runner feeds them to the
simulated system one arrival event at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from yuebing.core.errors import InputError, TraceFormatError

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the released Mooncake traces."""


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of the replayed trace."""

    index: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_keys: tuple[int, ...]
    """Chained prefix-block keys (trace ``hash_ids``), one per 512 tokens (last may be partial)."""


class _Line(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def _parse(path: Path) -> list[_Line]:
    decoder = msgspec.json.Decoder(_Line)
    lines: list[_Line] = []
    try:
        fh = path.open("rb")
    except OSError as e:
        raise InputError(f"cannot read trace {path}: {e}") from None
    with fh:
        for no, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            try:
                lines.append(decoder.decode(raw))
            except msgspec.ValidationError as e:
                field = str(e).rsplit("`$.", 1)[-1].rstrip("`") if "`$." in str(e) else "?"
                raise TraceFormatError(str(path), no, field, str(e)) from None
            except msgspec.DecodeError as e:
                raise TraceFormatError(str(path), no, "(line)", f"not JSON: {e}") from None
    return lines


def load_requests(path: str | Path, speed: float = 1.0, limit: int | None = None,
                  start: int = 0) -> list[SimRequest]:
    """Trace requests ``[start, start+limit)`` in arrival order, timestamps divided by ``speed``.

    Arrival times are shifted so the first selected request arrives at 0 s.
    """
    if not speed > 0:
        raise InputError(f"replay speed must be > 0, got {speed!r}")
    if start < 0 or (limit is not None and limit <= 0):
        raise InputError(f"start must be >= 0 and limit > 0 (got start={start}, limit={limit})")
    p = Path(path)
    lines = _parse(p)
    for no, ln in enumerate(lines, 1):
        if ln.input_length <= 0 or ln.output_length <= 0 or ln.timestamp < 0:
            raise TraceFormatError(str(p), no, "input_length/output_length/timestamp",
                                   "lengths must be > 0 and timestamp >= 0")
    order = sorted(range(len(lines)), key=lambda i: lines[i].timestamp)
    stop = len(order) if limit is None else min(len(order), start + limit)
    chosen = order[start:stop]
    if not chosen:
        raise InputError(f"{p}: no requests selected (start={start}, limit={limit})")
    t0 = lines[chosen[0]].timestamp
    return [
        SimRequest(index=k, arrival_s=(lines[i].timestamp - t0) / 1000.0 / speed,
                   input_tokens=lines[i].input_length, output_tokens=lines[i].output_length,
                   block_keys=tuple(lines[i].hash_ids))
        for k, i in enumerate(chosen)
    ]
