"""The mounted segments and allocation on them: `Segments`.

It owns the segment table (by id and by name), ids for new segments, and placement: `place`
allocates a put's ranges on distinct ACTIVE DRAM segments in the order of its placement
strategy. It also answers the lookups other components need (a node's segment of a tier, room
on active DRAM, usage) and marks segments SUSPECT after a failed write. Mounting, unmounting
and draining are `membership`'s; every other component reads segments here.
"""

from __future__ import annotations

import logging
import random

from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.effects import Effects
from yuebing.store.master.placement import PLACEMENTS, PlacementRequest
from yuebing.store.master.state import Seg, SegState

log = logging.getLogger(__name__)


class Segments:
    """``segs`` (id -> `Seg`, in mount order), ``by_name`` and ``next_id``."""

    __slots__ = ("by_name", "cfg", "effects", "next_id", "rng", "segs")

    def __init__(self, cfg: MasterConfig, rng: random.Random, effects: Effects) -> None:
        self.cfg = cfg
        self.rng = rng
        self.effects = effects
        self.segs: dict[int, Seg] = {}
        self.by_name: dict[str, int] = {}
        self.next_id = 1

    def add(self, sid: int, name: str, size: int, tier: int, node: str, client: str,
            alloc: OffsetAllocator | None, incarnation: str = "") -> Seg:
        s = Seg(sid, name, size, tier, node, client, alloc, incarnation)
        self.segs[sid] = s
        self.by_name[name] = sid
        self.next_id = max(self.next_id, sid + 1)
        return s

    def skip_ids(self, next_id: int) -> None:
        """New segments get ids from ``next_id`` on (a snapshot's: ids are never reused)."""
        self.next_id = max(self.next_id, next_id)

    def remove(self, sid: int) -> Seg:
        s = self.segs.pop(sid)
        del self.by_name[s.name]
        return s

    def clear(self) -> None:
        self.segs.clear()
        self.by_name.clear()

    def of_node(self, node: str, tier: int) -> Seg | None:
        """``node``'s ACTIVE segment of ``tier`` with an allocator, if any."""
        for s in self.segs.values():
            if s.node == node and s.tier == tier and s.state == SegState.ACTIVE and s.alloc:
                return s
        return None

    def active_dram(self) -> int:
        """How many DRAM segments take puts."""
        return sum(1 for s in self.segs.values()
                   if s.tier == m.Tier.DRAM and s.state == 0 and s.alloc is not None)

    def largest_free(self) -> int:
        """The largest free range on an ACTIVE DRAM segment (what a migration could get)."""
        return max((s.alloc.largest_free for s in self.segs.values()
                    if s.tier == m.Tier.DRAM and s.state == SegState.ACTIVE
                    and s.alloc is not None), default=0)

    def place(self, client: str, it: m.PutItem, least: int) -> list[tuple[int, int]]:
        """Allocate up to ``it.replicas`` ranges on distinct ACTIVE DRAM segments in the order
        of its placement strategy; fewer than ``least`` placed: none (the ranges are freed)."""
        need = 0
        cands: list[Seg] = []
        for s in self.segs.values():
            if s.tier == m.Tier.DRAM and s.state == 0 and s.alloc is not None:
                need = need or s.alloc.rounded(it.size)
                if s.alloc.largest_free >= need:
                    cands.append(s)
        if len(cands) < least:
            return []
        strategy = PLACEMENTS.get(it.strategy or self.cfg.placement)
        ordered = strategy(cands, PlacementRequest(it.size, it.preferred, client), self.rng)
        placed: list[tuple[int, int]] = []
        for s in ordered:
            off = s.alloc.alloc(it.size)  # type: ignore[union-attr]
            if off is not None:
                placed.append((s.id, off))
                if len(placed) == it.replicas:
                    break
        if len(placed) < least:
            for sid, off in placed:
                self.segs[sid].alloc.free_range(off, it.size)  # type: ignore[union-attr]
            return []
        return placed

    def suspect(self, names: list[str]) -> None:
        """A client could not write to these segments: place nothing there until their node
        heartbeats again (a dead node's segment would otherwise take puts until its TTL)."""
        for name in names:
            sid = self.by_name.get(name)
            s = self.segs.get(sid) if sid is not None else None
            if s is not None and s.state == SegState.ACTIVE:
                s.state = SegState.SUSPECT
                self.effects.counters["suspects"] += 1
                log.warning("segment %s suspected dead after a failed write", name)

    def usage(self) -> dict[str, float]:
        """Capacity and bytes allocated per tier."""
        out: dict[str, float] = {}
        for tier, name in ((0, "dram"), (1, "ssd")):
            allocs = [s.alloc for s in self.segs.values() if s.tier == tier and s.alloc is not None]
            out[f"{name}_capacity"] = float(sum(a.capacity for a in allocs))
            out[f"{name}_used"] = float(sum(a.used for a in allocs))
        return out
