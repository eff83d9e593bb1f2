"""Colocated nodes: a prefill and a decode node sharing one host slow each other down.

With ``SimConfig.colocated`` prefill node i and decode node i share host i, as 1P1D ``yuebing
serve`` runs on one machine. The factors are measured (``yuebing profile --interference``,
read by `load_interference`). `sim.mooncake.MooncakeSystem` keeps one `HostMate` per paired
prefill node: a prefill is stretched (`stretch`) over the window its partner decode node is
estimated busy, and the decode node (`sim.decode.DecodeInstance`, ``stretch=``) stretches each
step over the partner's prefill intervals (`HostMate.decode_step`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import msgspec

from yuebing.core.config import require
from yuebing.core.errors import InputError


@dataclass(frozen=True)
class Interference:
    """Slowdown of a decode step while the host-mate prefills, and of a prefill while the
    host-mate decodes (1.0 = none)."""

    decode_factor: float = 1.0
    prefill_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in ("decode_factor", "prefill_factor"):
            v = getattr(self, name)
            require(math.isfinite(v) and v > 0, f"{name} must be a finite number > 0, got {v}")


class _Factors(msgspec.Struct):
    decode_factor: float
    prefill_factor: float


class _WithInterference(msgspec.Struct):
    interference: _Factors | None = None


def load_interference(path: str | Path) -> Interference:
    """The factors in a ``yuebing profile --interference --samples`` file; a file without them
    (or a predictor file) raises `InputError` saying how to measure them."""
    p = Path(path)
    try:
        doc = msgspec.json.decode(p.read_bytes(), type=_WithInterference)
    except OSError as e:
        raise InputError(f"cannot read profile {p}: {e.strerror}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InputError(f"{p}: invalid interference factors: {e}") from None
    if doc.interference is None:
        raise InputError(f"{p} has no interference factors; colocated nodes need the samples "
                         f"file of `yuebing profile --interference --samples FILE`")
    try:
        return Interference(doc.interference.decode_factor, doc.interference.prefill_factor)
    except ValueError as e:
        raise InputError(f"{p}: {e}") from None


def stretch(start: float, work: float, busy_from: float, busy_until: float,
            factor: float) -> float:
    """Duration of ``work`` seconds (as profiled alone) started at ``start`` when it runs
    ``factor`` times slower inside [busy_from, busy_until) and at full speed outside it."""
    if work <= 0:
        return 0.0
    lo, hi = max(start, busy_from), busy_until
    if factor == 1.0 or hi <= lo:
        return work
    before = lo - start  # alone until the neighbour starts
    if work <= before:
        return work
    slow = (work - before) * factor  # then slowed, until done or the neighbour stops
    if slow <= hi - lo:
        return before + slow
    return before + (hi - lo) + (work - before - (hi - lo) / factor)


class HostMate:
    """The prefill intervals of the prefill node sharing a decode node's host (FIFO, so their
    starts increase), and the factor a decode step takes inside one.

    Approximations (docs/reproduction.md): a prefill's duration is decided when it is scheduled,
    from the decode work known then (a request joining the decode batch later does not lengthen
    it); a decode step is stretched only over the prefill interval it starts in or runs into (steps
    are tens of ms, prefills seconds). After a prefill is recorded (`add_prefill`) the decode node
    re-plans from its next step boundary."""

    def __init__(self, decode_factor: float) -> None:
        self.decode_factor = decode_factor
        self.intervals: deque[tuple[float, float]] = deque()

    def add_prefill(self, start: float, end: float, now: float) -> None:
        """Called by the system at ``now`` when it schedules a prefill on the partner node;
        intervals over by ``now`` are dropped (no step is planned before now)."""
        ivs = self.intervals
        while ivs and ivs[0][1] <= now:
            ivs.popleft()
        ivs.append((start, end))

    def decode_step(self, t: float, work: float) -> float:
        """Duration of a decode step of ``work`` s (alone) starting at ``t``: stretched over the
        first prefill interval that has not ended by ``t``."""
        for lo, hi in self.intervals:
            if hi > t:
                return stretch(t, work, lo, hi, self.decode_factor)
        return work
