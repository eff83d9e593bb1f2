"""The choice of room for one allocation: which window of adjacent ranges on one segment to
free (pure functions over a segment layout; `Eviction.make_room` calls them and evicts).

An allocation needs one free range of its (rounded) size on one segment, so freeing ``size``
bytes anywhere may free nothing usable. `pieces` lays each candidate segment out as free
ranges and evictable values; `window` picks the run that covers the size at the least cost:
LRU first (a replica whose value keeps another copy counts as older than any, a soft-pinned
value as newer than any), then the bytes evicted. Pending puts, reservations, quarantined
ranges, task destinations, hard-pinned and leased values are barriers no window crosses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import IntEnum

from yuebing.protocol.store_cluster import TaskKind
from yuebing.store.master.state import Obj, ObjState, Seg, Task

FREE, VICTIM, SOON, LATER = range(4)


class Room(IntEnum):
    """What `Eviction.make_room` achieved: a fit NOW (place again), one to WAIT for (offloads
    or read leases ending), or NONE."""

    NOW = 0
    WAIT = 1
    NONE = 2


@dataclass(slots=True)
class Piece:
    """A range of a segment's layout: free, a value that may be evicted (``rank``: its place in
    the LRU order, adjusted; ``size``: its bytes), or one freeing itself soon."""

    start: int
    end: int
    rank: int
    size: int
    kind: int
    key: str


def pieces(segs: dict[int, Seg], objs: dict[str, Obj], tasks: dict[int, Task], sids: list[int],
           now: float, wait_until: float) -> dict[int, list[Piece]]:
    """The layout of each segment of ``sids``: its free ranges and the ranges of values that
    may be evicted (read leases ending by ``wait_until`` as LATER, an offload from there as
    SOON), ranked by LRU order (``objs`` is in recency order); everything else is a barrier."""
    out: dict[int, list[Piece]] = {}
    for sid in sids:
        alloc = segs[sid].alloc
        assert alloc is not None
        out[sid] = [Piece(s, s + n, -1 << 62, 0, FREE, "") for s, n in alloc.free_ranges()]
    n_objs = len(objs) + 1
    for rank, (key, o) in enumerate(objs.items()):
        for r in o.reps:
            mine = out.get(r[0])
            if mine is None:
                continue
            if o.state != ObjState.COMMITTED or o.pin:
                continue
            kind = VICTIM
            if o.moving:
                t = tasks.get(o.moving)
                if t is None or t.kind != TaskKind.OFFLOAD or t.src != r:
                    continue
                kind = SOON
            elif o.lease > now:
                if o.lease > wait_until:
                    continue
                kind = LATER
            order = rank - n_objs if len(o.reps) > 1 else rank  # another copy: no loss
            if o.soft > now:
                order += 2 * n_objs
            alloc = segs[r[0]].alloc
            assert alloc is not None
            if kind == SOON:
                order, size = -1 << 62, 0
            else:
                size = o.size
            mine.append(Piece(r[1], r[1] + alloc.rounded(o.size), order, size, kind, key))
    return out


def window(pieces: list[Piece], need: int, late_ok: bool) -> tuple[tuple[int, int], list[Piece]] | None:
    """The cheapest run of adjacent pieces spanning ``need`` bytes — least (most recent rank,
    bytes evicted) — by two pointers over the pieces by offset, the shortest run ending at
    each piece (any run holds one, no dearer), its most recent rank kept in a monotonic deque.
    A gap — a barrier — ends a run; LATER pieces are barriers unless ``late_ok``."""
    ps = sorted((p for p in pieces if late_ok or p.kind != LATER), key=lambda p: p.start)
    best: tuple[tuple[int, int], list[Piece]] | None = None
    i = 0
    size = 0
    newest: deque[int] = deque()  # indexes in the run, ranks decreasing
    for j, p in enumerate(ps):
        if j > i and ps[j - 1].end != p.start:
            i, size = j, 0
            newest.clear()
        size += p.size
        while newest and ps[newest[-1]].rank <= p.rank:
            newest.pop()
        newest.append(j)
        while i < j and p.end - ps[i + 1].start >= need:
            size -= ps[i].size  # the run still fits without its first piece
            i += 1
            if newest[0] < i:
                newest.popleft()
        if p.end - ps[i].start >= need:
            cost = (ps[newest[0]].rank, size)
            if best is None or cost < best[0]:
                best = (cost, ps[i:j + 1])
    return best


def cheapest(layout: dict[int, list[Piece]], segs: dict[int, Seg], sids: list[int],
             size: int) -> tuple[int, list[Piece]] | None:
    """The segment and window to free for ``size`` bytes: the cheapest over ``sids`` without
    crossing a LATER piece, else the cheapest crossing them; None when there is none."""
    best: tuple[tuple[int, int], int, list[Piece]] | None = None
    for late_ok in (False, True):
        for sid in sids:
            alloc = segs[sid].alloc
            assert alloc is not None
            got = window(layout[sid], alloc.rounded(size), late_ok)
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], sid, got[1])
        if best is not None:
            break
    return None if best is None else (best[1], best[2])
