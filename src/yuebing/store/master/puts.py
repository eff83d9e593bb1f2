"""Two-phase puts: `Puts` checks and places a put, ends or revokes it, and holds the puts that
wait for room.

``put_start`` validates the item, places replicas on distinct DRAM segments (`Segments.place`;
when none fit, `Eviction.place` makes room) and records a PENDING object (`Objects.add`) no
reader sees; the client writes the bytes, then ``put_end`` commits it or ``put_revoke`` frees
it. A put whose room is on its way (offloads, leases ending) is parked (`first_try`) and run
again after each `TaskDone` and tick (`retry`) until it fits or ``room_wait_s`` passes. Pending
puts past their deadline are reclaimed as zombies. Called by `MasterCore` (which adds
reservations to the replies) and `Reserve`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.core.clock import Clock
from yuebing.protocol import Message
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.eviction import Eviction
from yuebing.store.master.objects import Objects
from yuebing.store.master.placement import PLACEMENTS
from yuebing.store.master.reservations import Reservations, check_key
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import ObjState

log = logging.getLogger(__name__)
C = m.Code
MAX_KEY = 4096
MAX_REPLICAS = 16
PENDING = ObjState.PENDING

Handler = Callable[[Message], Message | None]


def err(code: C, message: str) -> m.Err:
    return m.Err(code=int(code), message=message)


@dataclass(slots=True)
class Parked:
    """A request waiting for room: ``waiter`` gets the reply of ``msg`` once it fits, or its
    NO_SPACE after ``until`` (the core's clock)."""

    waiter: object
    msg: Message
    until: float


def needs_room(reply: Message | None) -> bool:
    """Whether ``reply`` is (or, for a batch, holds) a NO_SPACE refusal."""
    if isinstance(reply, m.Err):
        return reply.code == m.Code.NO_SPACE
    if isinstance(reply, m.BatchPutTargets):
        return m.Code.NO_SPACE in reply.codes
    return False


class Puts:
    """``parked``: puts waiting for room, oldest first; ``room_wait``: the last placement found
    no room but room is on its way."""

    __slots__ = ("book", "cfg", "clock", "effects", "eviction", "objects", "parked",
                 "room_wait", "segments")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, objects: Objects,
                 eviction: Eviction, book: Reservations, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.objects = objects
        self.eviction = eviction
        self.book = book
        self.effects = effects
        self.parked: list[Parked] = []
        self.room_wait = False

    # -------------------------------------------------------------- placing
    def check_item(self, it: m.PutItem) -> str:
        if not it.key or len(it.key) > MAX_KEY:
            return f"key must be 1..{MAX_KEY} characters"
        if it.size <= 0:
            return f"size must be > 0, got {it.size}"
        if not 1 <= it.replicas <= MAX_REPLICAS:
            return f"replicas must be 1..{MAX_REPLICAS}, got {it.replicas}"
        if not 0 <= it.min_replicas <= it.replicas:
            return f"min_replicas must be 0..replicas ({it.replicas}), got {it.min_replicas}"
        if it.strategy and it.strategy not in PLACEMENTS:
            return f"unknown placement {it.strategy!r}; known: {', '.join(PLACEMENTS.names())}"
        if it.soft_pin_s < 0:
            return f"soft_pin_s must be >= 0, got {it.soft_pin_s}"
        if not 0 <= it.timeout_s < float("inf"):
            return f"timeout_s must be >= 0 seconds (0 = the master's), got {it.timeout_s}"
        return ""

    def put_one(self, client: str, it: m.PutItem,
                internal: bool = False) -> tuple[C, list[m.Replica] | str]:
        """Place and allocate a pending put (``internal``: a reservation of `Reserve`, placed
        from free space only: no eviction for it, and no room is not counted as
        ``no_space``)."""
        problem = self.check_item(it) or ("" if internal else check_key(it.key))
        if problem:
            return C.BAD_REQUEST, problem
        segs = self.segments
        o = self.objects.objs.get(it.key)
        if o is not None:
            if o.state == PENDING and o.owner == client and o.size == it.size:
                # the same client retrying after a lost reply (e.g. failover): same targets
                return C.OK, [m.Replica(segment=segs.segs[s].name, offset=off)
                              for s, off in o.reps]
            return C.EXISTS, f"key {it.key!r} exists (values are immutable)"
        need = it.min_replicas or it.replicas
        placed = segs.place(client, it, need)
        if not placed and not internal and segs.active_dram() >= need:
            placed, wait = self.eviction.place(client, it, need)  # evicts one contiguous range
            self.room_wait |= wait
        if not placed:
            self.effects.counters["no_space"] += not internal
            return C.NO_SPACE, self.no_room(it, need)
        self.objects.add(client, it, placed)
        names = segs.segs
        return C.OK, [m.Replica(segment=names[s].name, offset=off) for s, off in placed]

    def no_room(self, it: m.PutItem, need: int) -> str:
        """Why a put needing ``need`` replicas could not be placed (the NO_SPACE message)."""
        if need == 1:
            return f"no DRAM segment has {it.size} free bytes"
        active = self.segments.active_dram()
        what = (f"only {active} DRAM segments take puts" if active < need else
                f"fewer than {need} of the {active} DRAM segments have {it.size} free bytes")
        return (f"{it.key!r} needs {need} replicas on distinct DRAM segments but {what} "
                "(put with best_effort to accept fewer)")

    # -------------------------------------------------------------- ending
    def put_end(self, msg: m.PutEnd) -> Message:
        code, text = self.objects.end(msg.client, msg.key)
        return m.Ok() if code == C.OK else err(code, text)

    def batch_put_end(self, msg: m.BatchPutEnd) -> Message:
        end = self.objects.end
        return m.Codes(codes=[int(end(msg.client, k)[0]) for k in msg.keys])

    def put_revoke(self, msg: m.PutRevoke) -> Message:
        self.segments.suspect(msg.failed)
        code, text = self.objects.revoke(msg.client, msg.key)
        return m.Ok() if code == C.OK else err(code, text)

    def revoke_many(self, client: str, keys: list[str], failed: list[str]) -> list[int]:
        """`BatchPutRevoke`'s codes for ``keys`` (the segments ``failed`` are suspected)."""
        self.segments.suspect(failed)
        return [int(self.objects.revoke(client, k)[0]) for k in keys]

    def reclaim_zombies(self) -> None:
        """Tick: drop the pending puts past their deadline (``put_timeout_s``)."""
        now = self.clock.now()
        objs = self.objects.objs
        for key in [k for k, d in self.objects.pending.items() if d < now]:
            if key in self.book.by_key:  # unused until its write expiry: expected
                self.effects.counters["reservations_expired"] += 1
                log.info("reservation %s expired unused", key)
            else:
                self.effects.counters["zombies"] += 1
                log.warning("reclaiming zombie put %s", key)
            self.objects.drop(key, objs[key], event=False)

    # -------------------------------------------------------------- waiting for room
    def first_try(self, msg: Message, waiter: object, handler: Handler) -> Message | None:
        """``MasterCore.handle`` of a `PutStart` / `BatchPutStart` (``handler``): its reply,
        or None when it waits for room (parked until `retry` places it or ``room_wait_s``
        passes)."""
        reply = self._attempt(msg, handler, last=False)
        if reply is None:
            self.parked.append(Parked(waiter, msg, self.clock.now() + self.cfg.room_wait_s))
        return reply

    def _attempt(self, msg: Message, handler: Handler, last: bool) -> Message | None:
        """Run ``handler``; None (nothing to answer yet) when an item found no room but room
        is on its way, unless ``last``. The items placed stay pending (a retry finds them
        again, as a resent request does), and a try that waits is not counted as
        ``no_space``."""
        counters = self.effects.counters
        before = counters["no_space"]
        self.room_wait = False
        reply = handler(msg)
        if not last and self.room_wait and needs_room(reply):
            counters["no_space"] = before
            return None
        return reply

    def retry(self, handlers: dict[type, Handler]) -> None:
        """Run the parked requests again, oldest first (after a `TaskDone`, and every tick):
        one that fits, or fails otherwise, or waited ``room_wait_s`` gets its reply."""
        if not self.parked:
            return
        parked, self.parked = self.parked, []
        now = self.clock.now()
        for p in parked:
            reply = self._attempt(p.msg, handlers[type(p.msg)], last=now >= p.until)
            if reply is None:
                self.parked.append(p)
            else:
                self.effects.ready.append((p.waiter, reply))
