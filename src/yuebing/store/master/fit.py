"""Room for one allocation: eviction of a contiguous range, and puts / reads that wait for it.

An allocation needs one free range of its (rounded) size on one segment, so freeing ``size``
bytes anywhere (LRU order across the cluster) may free nothing usable. `make_room` instead
looks at each candidate segment's layout — its free ranges, and the ranges of committed values
that may be evicted — and picks the window of adjacent ranges that covers the size at the least
cost, then frees exactly the values in it. The cost is LRU first: the window whose most
recently read victim is least recent wins (a replica whose value keeps another one counts as
older than any, since dropping it loses nothing; a soft-pinned value as newer than any), and
the bytes evicted decide between windows of equal rank. Pending puts, reservations, quarantined
ranges, task destinations, hard-pinned and leased values are barriers no window crosses; a
value being offloaded from the segment frees itself when its task ends (free soon, cost 0).

A victim in DRAM whose value has no other replica is offloaded to its node's SSD tier when there
is one (room is made there the same way, dropping SSD-tier values only when the SSD is full):
its DRAM range frees when the `OFFLOAD` task ends. `make_room` then answers `WAIT`, and the
caller parks: ``MasterCore.handle`` holds a put's (or batch put's) reply in `Parked` and `retry`
(after every `TaskDone`, and every tick) runs it again until it fits, or answers NO_SPACE after
``room_wait_s``; a value is never dropped from DRAM while its node's SSD has room. A window
blocked only by read leases that end within ``room_wait_s`` is also a `WAIT` (nothing is
evicted until the leases end). `NONE`: no window exists (everything there is pinned, pending
or leased for longer), and nothing was evicted — a put that cannot fit evicts nothing.

``keep_fit`` (every tick) keeps a free range of the largest size that lately found no room on
some DRAM segment whose free bytes are fragmented (at least twice the size free in all), so a
put rarely waits for its own eviction; it never evicts to make free bytes the watermark keeps
in use. Called by ``MasterCore`` (``handle``, ``_put_one``, ``task_done``, ``tick``) and,
through ``eviction.room_for``, by ``segments.promote`` and SSD room for an offload.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.cluster_messages import TaskKind
from yuebing.store.master.state import ObjState, SegState

if TYPE_CHECKING:
    from yuebing.protocol import Message
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)

FREE, VICTIM, SOON, LATER = range(4)


class Room(IntEnum):
    """What `make_room` achieved: a fit NOW (place again), one to WAIT for (offloads or read
    leases ending), or NONE."""

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


@dataclass(slots=True)
class Parked:
    """A request waiting for room: ``waiter`` gets the reply of ``msg`` once it fits, or its
    NO_SPACE after ``until`` (the core's clock)."""

    waiter: object
    msg: Message
    until: float


def make_room(core: MasterCore, size: int, sids: list[int], offload: bool = True) -> Room:
    """Free one range of ``size`` bytes on one of segments ``sids`` (all of one tier): the
    cheapest window (module docstring). Evicts only the values in that window."""
    sids = [s for s in sids if core.segs[s].alloc is not None]
    if not sids:
        return Room.NONE
    now = core.clock.now()
    wait_until = now + core.cfg.room_wait_s
    pieces = _pieces(core, sids, now, wait_until)
    best: tuple[tuple[int, int], int, list[Piece]] | None = None
    for late_ok in (False, True):
        for sid in sids:
            alloc = core.segs[sid].alloc
            assert alloc is not None
            got = _window(pieces[sid], alloc.rounded(size), late_ok)
            if got is not None and (best is None or got[0] < best[0]):
                best = (got[0], sid, got[1])
        if best is not None:
            break
    if best is None:
        return Room.NONE
    _, sid, window = best
    if any(p.kind == LATER for p in window):
        return Room.WAIT  # evict nothing yet: the leases end first
    waiting = any(p.kind == SOON for p in window)
    for p in window:
        if p.kind == VICTIM:
            waiting |= _evict(core, p.key, (sid, p.start), offload)
    return Room.WAIT if waiting else Room.NOW


def _pieces(core: MasterCore, sids: list[int], now: float,
            wait_until: float) -> dict[int, list[Piece]]:
    out: dict[int, list[Piece]] = {}
    for sid in sids:
        alloc = core.segs[sid].alloc
        assert alloc is not None
        out[sid] = [Piece(s, s + n, -1 << 62, 0, FREE, "") for s, n in alloc.free_ranges()]
    n_objs = len(core.objs) + 1
    tasks = core.tasks
    for rank, (key, o) in enumerate(core.objs.items()):
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
            alloc = core.segs[r[0]].alloc
            assert alloc is not None
            if kind == SOON:
                order, size = -1 << 62, 0
            else:
                size = o.size
            mine.append(Piece(r[1], r[1] + alloc.rounded(o.size), order, size, kind, key))
    return out


def _window(pieces: list[Piece], need: int, late_ok: bool) -> tuple[tuple[int, int], list[Piece]] | None:
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


def _evict(core: MasterCore, key: str, rep: tuple[int, int], offload: bool) -> bool:
    """Free ``key``'s replica ``rep``: dropped when the value keeps another replica (or cannot
    be offloaded), else offloaded to its node's SSD tier. Returns True when the range frees
    later (an offload started)."""
    from yuebing.store.master import eviction

    o = core.objs.get(key)
    if o is None or rep not in o.reps or o.moving:
        return False
    s = core.segs[rep[0]]
    if offload and s.tier == m.Tier.DRAM and len(o.reps) == 1 and eviction.offload_to_ssd(core, key, rep):
        return True
    eviction.drop_replicas(core, key, [rep])
    return False


# ---------------------------------------------------------------------- puts
def place(core: MasterCore, client: str, it: m.PutItem, need: int) -> list[tuple[int, int]]:
    """Place ``it`` (at least ``need`` replicas) after its first try found no room: make one
    range of room per missing replica (`eviction.room_for` on the active DRAM segments that
    have none), placing again after each. Returns the placement, or [] — then
    ``core.room_wait`` says whether room is on its way (offloads, leases ending)."""
    from yuebing.store.master import eviction

    note_size(core, it.size)
    for _ in range(need):
        short = [s.id for s in core.segs.values() if s.tier == m.Tier.DRAM
                 and s.state == SegState.ACTIVE and s.alloc is not None
                 and s.alloc.largest_free < s.alloc.rounded(it.size)]
        got = eviction.room_for(core, it.size, short)
        if got != Room.NOW:
            core.room_wait |= got == Room.WAIT
            return []
        placed = core._place(client, it, need)
        if placed:
            return placed
    return []


# ---------------------------------------------------------------------- waiting requests
def first_try(core: MasterCore, msg: Message, waiter: object) -> Message | None:
    """``MasterCore.handle`` of a `PutStart` / `BatchPutStart`: its reply, or None when it
    waits for room (parked until `retry` places it or ``room_wait_s`` passes)."""
    reply = _attempt(core, msg, last=False)
    if reply is None:
        core.parked.append(Parked(waiter, msg, core.clock.now() + core.cfg.room_wait_s))
    return reply


def _attempt(core: MasterCore, msg: Message, last: bool) -> Message | None:
    """Run ``msg``'s handler; None (nothing to answer yet) when an item found no room but room
    is on its way, unless ``last``. The items placed stay pending (a retry finds them again,
    as a resent request does), and a try that waits is not counted as ``no_space``."""
    before = core.counters["no_space"]
    core.room_wait = False
    reply = core.handlers[type(msg)](msg)
    if not last and core.room_wait and needs_room(reply):
        core.counters["no_space"] = before
        return None
    return reply


def retry(core: MasterCore) -> None:
    """Run the parked requests again, oldest first (after a `TaskDone`, and every tick): one
    that fits, or fails otherwise, or waited ``room_wait_s`` gets its reply."""
    if not core.parked:
        return
    parked, core.parked = core.parked, []
    now = core.clock.now()
    for p in parked:
        reply = _attempt(core, p.msg, last=now >= p.until)
        if reply is None:
            core.parked.append(p)
        else:
            core.ready.append((p.waiter, reply))


def needs_room(reply: Message | None) -> bool:
    """Whether ``reply`` is (or, for a batch, holds) a NO_SPACE refusal."""
    if isinstance(reply, m.Err):
        return reply.code == m.Code.NO_SPACE
    if isinstance(reply, m.BatchPutTargets):
        return m.Code.NO_SPACE in reply.codes
    return False


# ---------------------------------------------------------------------- background
FIT_MEMORY_S = 10.0
"""How long ``keep_fit`` keeps room for a size that once found none."""


def note_size(core: MasterCore, size: int) -> None:
    """Remember a size that found no room (``keep_fit`` keeps room for the largest lately)."""
    now = core.clock.now()
    if size >= core.fit_size or now >= core.fit_until:
        core.fit_size = size
    core.fit_until = now + FIT_MEMORY_S


def keep_fit(core: MasterCore) -> None:
    """Every tick: when no active DRAM segment has a free range of the largest size that found
    no room lately, make one (offloading victims where there is an SSD tier) on a segment
    whose free bytes are at least twice that size — free space that fragmentation made
    useless, not space the watermark leaves in use — so the next put of that size does not
    wait for its own eviction."""
    size = core.fit_size
    if not size:
        return
    if core.clock.now() >= core.fit_until:
        core.fit_size = 0
        return
    dram = [s for s in core.segs.values() if s.tier == m.Tier.DRAM
            and s.state == SegState.ACTIVE and s.alloc is not None]
    if not dram or any(t.kind == TaskKind.OFFLOAD for t in core.tasks.values()):
        return  # none, or room is on its way
    if any(s.alloc.largest_free >= s.alloc.rounded(size) for s in dram):  # type: ignore[union-attr]
        return
    loose = [s.id for s in dram if s.alloc.free >= 2 * s.alloc.rounded(size)]  # type: ignore[union-attr]
    if loose:
        make_room(core, size, loose)
