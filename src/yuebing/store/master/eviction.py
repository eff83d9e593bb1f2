"""Approximate-LRU eviction of the master core.

The object dict is kept in recency order (``get_replicas`` moves a key to the end), so the
eviction scan walks from the least recently read. Leased, hard-pinned and moving objects are
never evicted; soft-pinned objects (pin not yet expired) only in a second pass when the first
freed too little. It is approximate because a scan visits at most ``SCAN_LIMIT`` objects and
probes (exists, prefix_match) do not count as use.

Draining segments lose their redundant replicas (``drain``: once no reader leases the value,
a replica on a draining segment is dropped when the value has another one on a segment that is
not draining, with a REMOVED event; only the keys `migration.index` filed as spare there are
walked); values whose every replica is draining are left to `migration`, which copies them
elsewhere first.
Two triggers: ``watermark`` (every tick: DRAM usage above ``high_watermark`` evicts down to
``high_watermark - evict_ratio`` in LRU order; on a node with an SSD tier a victim is offloaded
there instead of dropped, asynchronously) and ``room_for`` (an allocation failed: `fit` frees
one contiguous range of the size on one segment, offloading DRAM victims where there is an SSD
tier). Quarantined ranges (`fence`) free themselves within seconds, so neither trigger evicts
for them: ``watermark`` does not count them as used, and ``room_for`` / ``evict_for`` first
release the entries that are due and evict only when that was not enough.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.cluster_messages import EventKind, TaskKind
from yuebing.store.master import fit, migration
from yuebing.store.master.segments import ssd_of, start_task
from yuebing.store.master.state import ObjState, SegState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
SCAN_LIMIT = 200_000


def watermark(core: MasterCore) -> int:
    """Evict (offloading where possible) when DRAM usage, not counting quarantined ranges,
    passes the high watermark. Called by the core's tick."""
    cap = used = 0
    q = core.quarantine
    for s in core.segs.values():
        if s.tier == 0 and s.alloc is not None:
            cap += s.alloc.capacity
            used += s.alloc.used - q.held(s.id)
    in_flight = sum(t.size for t in core.tasks.values() if t.kind == TaskKind.OFFLOAD)
    if not cap or used - in_flight <= core.cfg.high_watermark * cap:
        return 0
    target = (core.cfg.high_watermark - core.cfg.evict_ratio) * cap
    return evict_for(core, int(used - in_flight - target), offload=True)


def drain(core: MasterCore) -> int:
    """Drop the replicas on draining segments of values that keep one elsewhere (no reader may
    still hold that replica — `migration.reader_may_hold` —, not moving); returns the bytes freed. Called every tick; walks only the keys that
    `migration.index` filed as spare on draining segments that still hold something."""
    draining = [s.id for s in core.segs.values()
                if s.state == SegState.DRAINING and s.alloc is not None and s.alloc.used]
    if not draining:
        return 0
    migration.index(core)
    d = core.drains
    now = core.clock.now()
    segs = core.segs
    picked: dict[str, list[tuple[int, int]]] = {}
    freed = 0
    for sid in draining:
        spare = d.spare.get(sid)
        if not spare:
            continue
        gone = []
        for key in spare:
            o = core.objs.get(key)
            if o is None or not any(r[0] == sid for r in o.reps):
                gone.append(key)
                continue
            if (o.state != ObjState.COMMITTED or o.moving or key in picked
                    or migration.reader_may_hold(core, key, o, sid, now)):
                continue
            mine = [r for r in o.reps if segs[r[0]].state == SegState.DRAINING
                    and not migration.reader_may_hold(core, key, o, r[0], now)]
            if len(mine) < len(o.reps):
                picked[key] = mine
                freed += o.size * len(mine)
        spare.difference_update(gone)
    for key, mine in picked.items():  # act after the scan: dropping mutates the sets
        drop_replicas(core, key, mine)
    return freed


def evict_for(core: MasterCore, need: int, only: set[int] | None = None, tier: int = 0,
              offload: bool = False) -> int:
    """Free at least ``need`` bytes of ``tier`` (on segments ``only``, if given) in LRU order,
    wherever they are: quarantined ranges due by now first, then by eviction. Returns the
    bytes freed or scheduled to be freed by offloads. Called by ``watermark``."""
    freed = _release_due(core, only, tier)
    for soft_ok in (False, True):
        if freed >= need:
            break
        freed += _scan(core, need - freed, only, tier, offload, soft_ok)
    if freed:
        log.info("freed %d bytes (needed %d, tier %d)", freed, need, tier)
    return freed


def room_for(core: MasterCore, size: int, sids: list[int], offload: bool = True) -> fit.Room:
    """Make one free range of ``size`` bytes on one of segments ``sids`` (one tier): release
    the quarantined ranges due by now, then `fit.make_room` if still none fits. Called by a
    failed allocation (`fit.place`, ``segments.promote``) and SSD room for an offload."""
    segs = core.segs
    if not sids:
        return fit.Room.NONE
    tier = segs[sids[0]].tier

    def fits() -> bool:
        return any((a := segs[s].alloc) is not None and a.largest_free >= a.rounded(size)
                   for s in sids)

    if _release_due(core, set(sids), tier) and fits():
        return fit.Room.NOW
    return fit.make_room(core, size, sids, offload)


def _release_due(core: MasterCore, only: set[int] | None, tier: int) -> int:
    """Release every quarantined range due by now; returns the bytes released on ``tier``
    (segments ``only``, if given)."""
    q = core.quarantine
    mine = [sid for sid, s in core.segs.items()
            if s.tier == tier and (only is None or sid in only)]
    before = sum(q.held(sid) for sid in mine)
    if not before:
        return 0
    q.release_due(core.clock.now(), core.segs)
    return before - sum(q.held(sid) for sid in mine)


def _victims(core: MasterCore, only: set[int] | None, tier: int, soft_ok: bool):
    now = core.clock.now()
    segs = core.segs
    for n, (key, o) in enumerate(core.objs.items()):
        if n >= SCAN_LIMIT:
            return
        if (o.state != ObjState.COMMITTED or o.lease > now or o.pin or o.moving
                or (not soft_ok and o.soft > now)):
            continue
        mine = [r for r in o.reps if segs[r[0]].tier == tier and (only is None or r[0] in only)]
        if mine:
            yield key, o, mine


def _scan(core: MasterCore, need: int, only: set[int] | None, tier: int, offload: bool,
          soft_ok: bool) -> int:
    picked: list[tuple[str, int]] = []
    total = 0
    for key, o, mine in _victims(core, only, tier, soft_ok):
        if total >= need:
            break
        picked.append((key, o.size))
        total += o.size * len(mine)
    freed = 0
    segs = core.segs
    for key, _ in picked:  # act after the scan: making SSD room mutates the object dict
        o = core.objs.get(key)
        if o is None or o.moving:
            continue
        mine = [r for r in o.reps if segs[r[0]].tier == tier and (only is None or r[0] in only)]
        if not mine:
            continue
        if tier == 0 and offload and len(mine) == len(o.reps) and any(  # through any replica
                offload_to_ssd(core, key, r) for r in mine):  # whose node has an SSD with room
            freed += o.size
            continue
        drop_replicas(core, key, mine)
        freed += o.size * len(mine)
    return freed


def offload_to_ssd(core: MasterCore, key: str, src: tuple[int, int]) -> bool:
    """Start offloading ``key``'s DRAM replica ``src`` to its node's SSD tier, making one
    contiguous range of room there (dropping SSD-tier values) when none is free; False when
    the node has no active SSD tier or no room can be made."""
    o = core.objs[key]
    dst = ssd_of(core, core.segs[src[0]].node, m.Tier.SSD)
    if dst is None:
        return False
    if start_task(core, key, o, src, dst, promote=False):
        return True
    return (room_for(core, o.size, [dst.id], offload=False) == fit.Room.NOW
            and start_task(core, key, o, src, dst, promote=False))


def drop_replicas(core: MasterCore, key: str, mine: list[tuple[int, int]]) -> None:
    o = core.objs[key]
    core.counters["evictions"] += 1
    if len(mine) == len(o.reps):
        core._drop(key, o)
        return
    for sid, off in mine:
        alloc = core.segs[sid].alloc
        if alloc is not None:
            alloc.free_range(off, o.size)
    o.reps = tuple(r for r in o.reps if r not in mine)
    migration.recheck(core, key, o)  # its surviving replicas may all be draining now
    core.events.append((EventKind.REMOVED, key, [core.segs[sid].name for sid, _ in mine]))
    core._log(["reps", key, o.reps])
