"""Replica placement strategies, registered by name in `PLACEMENTS`.

Called by the master core on put_start: a strategy orders the candidate DRAM segments (active,
not draining, with a free range big enough); the core then allocates on the first ``n`` distinct
segments it can, falling through the order when one is full. No I/O, no side effects.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from yuebing.core.registry import Registry
from yuebing.store.master.state import Seg


@dataclass(frozen=True)
class PlacementRequest:
    size: int
    preferred: Sequence[str] = ()
    local: str = ""
    """Node or segment name of the writer (for local_first)."""


Strategy = Callable[[list[Seg], PlacementRequest, random.Random], list[Seg]]
PLACEMENTS: Registry[Strategy] = Registry("placement strategy")


def _free_ratio_key(s: Seg) -> float:
    assert s.alloc is not None
    return -(s.alloc.free / s.size)


@PLACEMENTS.register("free_ratio")
def free_ratio_first(segs: list[Seg], req: PlacementRequest, rng: random.Random) -> list[Seg]:
    """Most free (by ratio) first: spreads load evenly over unequal segments."""
    return sorted(segs, key=_free_ratio_key)


@PLACEMENTS.register("random")
def random_order(segs: list[Seg], req: PlacementRequest, rng: random.Random) -> list[Seg]:
    out = list(segs)
    rng.shuffle(out)
    return out


@PLACEMENTS.register("local_first")
def local_first(segs: list[Seg], req: PlacementRequest, rng: random.Random) -> list[Seg]:
    """The writer's own segments (by node or segment name) first, then free_ratio order."""
    ordered = free_ratio_first(segs, req, rng)
    local = [s for s in ordered if req.local and req.local in (s.node, s.name)]
    return local + [s for s in ordered if s not in local]


@PLACEMENTS.register("preferred")
def preferred_first(segs: list[Seg], req: PlacementRequest, rng: random.Random) -> list[Seg]:
    """Segments named in ``preferred`` (in that order) first, then free_ratio order."""
    by_name = {s.name: s for s in segs}
    first = [by_name[n] for n in req.preferred if n in by_name]
    return first + [s for s in free_ratio_first(segs, req, rng) if s not in first]
