"""Colocated nodes: prefill and decode nodes sharing one host slow each other down.

With ``SimConfig.colocated`` prefill node i and decode node i share host i (`HostMate`); with
``SimConfig.host_cores`` as well, every node shares one host of that many cores, one engine
thread each, as ``yuebing serve`` runs on one machine (`SharedHost`). A pipeline group of
prefill nodes keeps each of its nodes busy (declared groups' stage nodes: refused). The factors
beside a neighbour are measured (``yuebing profile --interference``, read by `load_interference`).
`sim.mooncake.MooncakeSystem` stretches a prefill (`stretch`) over the window the decode is
estimated busy, and each decode step (`sim.decode.DecodeInstance`, ``stretch=``) over the
prefill intervals it meets (`HostMate.decode_step`, `SharedHost.decode_step`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
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


EDGE = 1e-9
"""A step asked for this close (in chunks) after a chunk end starts at it (float rounding)."""


class SharedHost:
    """Every node on one host of ``cores`` cores, one engine thread each: the prefill intervals
    of each prefill node (with their chunk counts), and the time a step takes among them.

    As live (`yuebing.instance.cores.CoreLedger`), a decode node's core is reserved while it has
    work (``reserved``: one per decode node, all counted busy, at most ``cores`` - 1), so the
    prefills take turns on the ``free`` rest, and a decode step beside k prefilling nodes runs
    at once, slowed by the measured ``decode_factor`` (caches, memory bandwidth) while k >= 1.
    Only when the decode nodes outnumber their reservation (1P2D on 2 cores) does a step wait
    for the first of the chunks running to end, and a prefill lose one decode step per chunk
    (`prefill_factors`). On 2 cores 1P1D and 2P1D thus step at their profiled time. Not
    modelled: cores lent by idle instances (live ``--lend-cores``), a decode that gets work
    while the prefills hold every core (live: it waits for one chunk end), the Conductor's and
    the load generator's CPU."""

    def __init__(self, cores: int, decode_factor: float, prefill_nodes: int,
                 decode_nodes: int) -> None:
        require(cores >= 1 and prefill_nodes >= 1 and decode_nodes >= 1,
                f"a shared host needs cores, prefill and decode nodes >= 1, got {cores}, "
                f"{prefill_nodes}, {decode_nodes}")
        self.cores = cores
        self.decode_factor = decode_factor
        self.other_decodes = decode_nodes - 1
        self.reserved = min(decode_nodes, cores - 1)
        """Cores the decode nodes' claims keep from the prefills while they have work (a
        prefill's one thread always keeps a core: `CoreLedger`'s cap)."""
        self.free = cores - self.reserved
        """Cores the prefills take turns on while the decode nodes have work."""
        self.intervals: list[deque[tuple[float, float, int]]] = [
            deque() for _ in range(prefill_nodes)]
        """Per prefill node, its scheduled prefills: (start, end, chunks)."""

    def prefill_factors(self, busy_prefills: int, prefill_factor: float, chunk_s: float,
                        step_s: float, threads: int = 1) -> tuple[float, float]:
        """A prefill's slowdown beside ``busy_prefills`` other prefilling nodes, on ``threads``
        nodes of its own (a pipeline group: one per stage, all busy), its steps ``chunk_s``
        long: (while the decode nodes are idle: the cores time-shared if the prefills alone
        outnumber them; extra while they step: the ``free`` cores time-shared the same way,
        times the measured ``prefill_factor``, and a decode step of ``step_s`` per step when
        the decode nodes outnumber their reservation). The prefill placed later takes the
        whole sharing (one placed earlier keeps its end)."""
        alone = max(1.0, (busy_prefills + threads) / self.cores)
        turns = max(1.0, (busy_prefills + threads) / self.free)
        crowded = self.other_decodes + 1 > self.reserved
        beside = (chunk_s + step_s) / chunk_s if crowded and chunk_s > 0 else 1.0
        return alone, prefill_factor * beside * turns / alone

    def add_prefill(self, node: int, start: float, end: float, now: float,
                    chunks: int = 1) -> None:
        """Called by the system at ``now`` when it schedules a prefill of ``chunks`` engine
        steps on prefill ``node``; that node's intervals over by ``now`` are dropped."""
        ivs = self.intervals[node]
        while ivs and ivs[0][1] <= now:
            ivs.popleft()
        ivs.append((start, end, max(1, chunks)))

    def busy_at(self, t: float, but: Collection[int] = ()) -> int:
        """Prefill nodes (other than those in ``but``) prefilling at ``t``."""
        return sum(1 for n, ivs in enumerate(self.intervals) if n not in but
                   and any(lo <= t < hi for lo, hi, _ in ivs))

    def decode_step(self, t: float, work: float) -> float:
        """Duration of a decode step of ``work`` s (alone) asked for at ``t``: the wait for a
        core (the first chunk end of the prefills running, when the prefills, at most
        ``free`` at a time, leave none), then the step, slowed by ``decode_factor`` beside a
        prefill."""
        busy = [iv for q in self.intervals for iv in q if iv[0] <= t < iv[1]]
        if not busy:
            return work
        if min(len(busy), self.free) + self.other_decodes + 1 <= self.cores:
            return work * self.decode_factor
        start = min(min(hi, lo + math.ceil((t - lo) * n / (hi - lo) - EDGE) * (hi - lo) / n)
                    for lo, hi, n in busy)  # the first chunk end at or after t
        return max(0.0, start - t) + work * self.decode_factor
