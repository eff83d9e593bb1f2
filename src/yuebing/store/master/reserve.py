"""Reservations (one-RPC puts): `Reserve` places space ahead for a client's next put of the
same shape, so a stream of same-shaped values costs one RPC (`PutCommit`) instead of two.

A reservation is a pending put under an internal key (``RESERVED_PREFIX + client/n``), placed
from free space only (never evicts), at most `MAX_SHAPES` shapes and `MAX_PER_CLIENT` per client.
`commit` checks it (pending, this client's, write expiry not passed, same shape, key free),
renames it to the key, commits it and may hand out the next; a retried commit that landed
answers OK (the book's record of recent commits); `commit_landed` is `commit` as a node reports
it landed with the write (the range checked against the reservation), and a revoke of a reservation
such a commit consumed answers COMMITTED (`landed_already`). `give_back` frees unused ones at once;
`drop_on_segment` drops them on a draining or unmounted segment. Its book is `reservations`.
Called by `MasterCore` (put handlers), `Membership` and `Replication` (``resv``/``rename``).
"""

from __future__ import annotations

import logging
from typing import Any

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.objects import Objects
from yuebing.store.master.puts import Puts
from yuebing.store.master.reservations import Reservations, check_key, shape_of
from yuebing.store.master.state import ObjState

log = logging.getLogger(__name__)
C = m.Code
MAX_SHAPES = 4
"""Shapes a client holds reservations of (a new shape beyond gets none)."""
MAX_PER_CLIENT = 64
"""Reservations a client holds in all (a batch of more items reserves this many)."""


def check_reserve_next(n: int) -> str:
    """The refusal for a batch's ``reserve_next`` ('' when fine; above the cap it is capped)."""
    return f"reserve_next must be >= 0, got {n}" if n < 0 else ""


def one_shape(items: list[m.PutItem]) -> bool:
    """Whether ``items`` (at least one) all have one shape (reservations are per shape)."""
    if not items:
        return False
    first = shape_of(items[0])
    return all(shape_of(it) == first for it in items[1:])


class Reserve:
    """The reservation rules over the book (`Reservations`, which it writes) and `Puts`."""

    __slots__ = ("book", "cfg", "clock", "effects", "objects", "puts")

    def __init__(self, cfg: MasterConfig, clock: Clock, book: Reservations, objects: Objects,
                 puts: Puts, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.book = book
        self.objects = objects
        self.puts = puts
        self.effects = effects

    def reserve(self, client: str, item: m.PutItem) -> m.Reservation | None:
        """A reservation of ``item``'s shape for ``client`` (its oldest one of that shape, or
        a new one); None when there is no room (the next put then goes the two-phase way)."""
        got = self.reserve_many(client, item, 1)
        return got[0] if got else None

    def reserve_many(self, client: str, item: m.PutItem, n: int) -> list[m.Reservation]:
        """Up to ``n`` (at most `MAX_PER_CLIENT`) reservations of ``item``'s shape for
        ``client``: the ones it holds of that shape first, then new ones while there is free
        room and the client is within its caps: a new shape beyond `MAX_SHAPES` gets none, and
        so do ``n`` that the cap on reservations in all would cut short (a batch can only use
        n)."""
        rs = self.book
        shape = shape_of(item)
        n = max(0, min(n, MAX_PER_CLIENT))
        keys = rs.held(client, shape)
        count = rs.count(client)
        if (not keys and len(rs.by_client.get(client, {})) >= MAX_SHAPES) \
                or count + n - len(keys) > MAX_PER_CLIENT:
            n = min(n, len(keys))
        objects, expiry = self.objects, self.objects.fence.expiry
        while len(keys) < n:
            key = rs.new_key(client, self.objects.objs)
            resv = m.PutItem(key=key, size=item.size, replicas=item.replicas,
                             strategy=item.strategy, preferred=item.preferred,
                             timeout_s=item.timeout_s)
            code, _ = self.puts.put_one(client, resv, internal=True)
            if code != C.OK:
                break
            rs.add(key, client, shape)
            objects.due_at_expiry(key)  # useless after its write expiry: reclaimed then
            self.effects.entry(["resv", key, item.replicas, item.strategy, list(item.preferred)])
            self.effects.counters["reservations_made"] += 1
            keys.append(key)
            count += 1
        segs, objs, now = objects.segments.segs, objects.objs, self.clock.now()
        return [m.Reservation(key=key, replicas=[m.Replica(segment=segs[s].name, offset=off)
                                                 for s, off in objs[key].reps],
                              expires_in_s=max(0.0, expiry[key] - now))  # as `expires_in`
                for key in keys[:n]]

    # -------------------------------------------------------------- commits
    def commit(self, msg: m.PutCommit) -> m.Message:
        """Handle `PutCommit`; a refusal changes nothing except that an expired reservation
        is dropped."""
        code, text = self._commit_one(msg.client, msg.reservation, msg.item)
        if code != C.OK:
            return m.Err(code=int(code), message=text)
        return m.PutCommitted(reservation=self.reserve(msg.client, msg.item)
                              if msg.reserve_next else None)

    def commit_landed(self, msg: m.PutCommit, sid: int, offset: int,
                      size: int) -> m.Message | None:
        """`commit` of a `PutCommit` a node reports landed (`store_cluster.Landed`) at
        [``offset``, ``offset + size``) of segment ``sid``: only when that range is exactly the
        one replica of ``msg.client``'s pending reservation (never for one revoked, expired,
        reclaimed, used or another's: the write fence holds as for the client's own commit);
        None otherwise — nothing changes, and the client commits itself."""
        name = msg.reservation
        got = self.book.by_key.get(name)
        o = self.objects.objs.get(name)
        if (got is None or got[0] != msg.client or o is None or o.state != ObjState.PENDING
                or o.size != size or len(o.reps) != 1 or tuple(o.reps[0]) != (sid, offset)):
            return None
        reply = self.commit(msg)
        if isinstance(reply, m.PutCommitted):
            self.effects.counters["landed_commits"] += 1
        return reply

    def landed_already(self, client: str, name: str) -> bool:
        """Whether ``client``'s reservation ``name`` (no longer pending) was consumed by a
        commit of ``client`` whose value is still stored: a revoke of it comes from a client
        that saw its write fail after the node had landed the frame and handed on its commit
        (`commit_landed`), so the put is done (`m.Code.COMMITTED`), not to be put again."""
        key = self.book.consumed_for(client, name)
        return key is not None and self.objects.committed_by(client, key) is not None

    def batch_commit(self, msg: m.BatchPutCommit) -> m.Message:
        """Handle `BatchPutCommit`: each item as a `PutCommit` into its reservation, then
        (asked, and the items of one shape) the next batch's reservations."""
        problem = check_reserve_next(msg.reserve_next)
        if not msg.items:
            problem = "a batch commit needs at least one item"
        elif len(msg.reservations) != len(msg.items):
            problem = f"{len(msg.reservations)} reservations for {len(msg.items)} items"
        if problem:
            return m.Err(code=C.BAD_REQUEST, message=problem)
        codes = [int(self._commit_one(msg.client, name, it)[0])
                 for name, it in zip(msg.reservations, msg.items, strict=True)]
        nxt = self.reserve_many(msg.client, msg.items[0], msg.reserve_next) \
            if msg.reserve_next > 0 and one_shape(msg.items) else []
        return m.BatchPutCommitted(codes=codes, reservations=nxt)

    def _commit_one(self, client: str, name: str, it: m.PutItem) -> tuple[C, str]:
        """Store ``it`` through ``client``'s reservation ``name``: (OK, "") — also for a retry
        whose first try committed (reply lost, failover) — or the refusal, which changes
        nothing except that an expired reservation is dropped."""
        problem = self.puts.check_item(it) or check_key(it.key)
        if problem:
            return C.BAD_REQUEST, problem
        key = it.key
        objects = self.objects
        got = self.book.by_key.get(name)
        o = objects.objs.get(name)
        if got is None or o is None or o.state != ObjState.PENDING:
            done = objects.committed_by(client, key)
            if (done is not None and (done.size, done.checksum) == (it.size, it.checksum)
                    and (it.checksum != -1  # same bytes (w.h.p.): answering OK changes nothing
                         or self.book.consumed_for(client, name) == key)):
                return C.OK, ""  # the caller's `reserve` returns the next one it may have placed
            return C.NOT_PENDING, (f"no reservation {name!r} (revoked, expired, reclaimed or "
                                   "already used); put the value again")
        if got[0] != client:
            return C.NOT_PENDING, f"reservation {name!r} belongs to another client"
        now = self.clock.now()
        late = now - objects.fence.expiry.get(name, now)
        if late > 0:
            self.drop(name, "write expiry passed")
            return C.NOT_PENDING, (f"reservation {name!r} passed its write expiry "
                                   f"{late:.3f}s ago; put the value again")
        if shape_of(it) != got[1]:
            return C.BAD_REQUEST, (f"reservation {name!r} was placed for (size, replicas, "
                                   f"strategy, preferred) = {got[1]}, not {shape_of(it)}")
        if key in objects.objs:
            return C.EXISTS, f"key {key!r} exists (values are immutable)"
        self.rename(name, key, it)
        code, text = objects.end(client, key)
        if code != C.OK:
            return code, text
        self.effects.counters["reservations_committed"] += 1
        return C.OK, ""

    def rename(self, name: str, key: str, it: m.PutItem) -> None:
        """Reservation ``name`` becomes the pending put of ``key`` with ``it``'s checksum and
        pins (on the leader at commit; on a standby from a ``rename`` entry)."""
        o = self.objects.rename(name, key)
        self.book.discard(name)
        if o.owner is not None:
            self.book.consumed(o.owner, name, key)
        o.checksum = it.checksum
        o.pin = it.hard_pin
        o.soft = self.clock.now() + it.soft_pin_s if it.soft_pin_s else 0.0
        self.effects.entry(["rename", name, key, it.checksum, it.hard_pin, it.soft_pin_s])

    # -------------------------------------------------------------- standby side
    def apply_rename(self, e: list[Any]) -> None:
        """A ``rename`` entry."""
        _, name, key, checksum, pin, soft_s = e
        self.rename(name, key, m.PutItem(key=key, size=1, checksum=checksum, hard_pin=pin,
                                         soft_pin_s=soft_s))

    def apply_resv(self, e: list[Any]) -> None:
        """A ``resv`` entry (also a snapshot row with the tag in front)."""
        _, key, replicas, strategy, preferred = e
        o = self.objects.objs[key]
        assert o.owner is not None
        self.book.add(key, o.owner, (o.size, replicas, strategy, tuple(preferred)))

    # -------------------------------------------------------------- giving up
    def drop(self, key: str, why: str) -> None:
        """Give a reservation up (its ranges wait out the write fence); its next commit is
        refused."""
        o = self.objects.objs.get(key)
        if o is not None and o.state == ObjState.PENDING:
            log.info("reservation %s dropped: %s", key, why)
            self.objects.drop(key, o, event=False)

    def give_back(self, client: str, keys: list[str]) -> list[int]:
        """``client`` gives back its reservations ``keys`` unused (it never wrote into them
        nor will): each is freed at once, not fenced. A code per key: NOT_PENDING for a key
        that is not a pending reservation of ``client`` (gone already — nothing to do)."""
        out: list[int] = []
        objs = self.objects.objs
        for key in keys:
            got = self.book.by_key.get(key)
            o = objs.get(key)
            if got is None or got[0] != client or o is None or o.state != ObjState.PENDING:
                out.append(int(C.NOT_PENDING))
                continue
            self.objects.drop(key, o, event=False, fenced=False)
            self.effects.counters["reservations_returned"] += 1
            out.append(int(C.OK))
        return out

    def drop_on_segment(self, sid: int, why: str) -> None:
        """Drop every reservation with a replica on segment ``sid`` (draining or unmounted)."""
        objs = self.objects.objs
        for key in [k for k in self.book.by_key
                    if k in objs and any(r[0] == sid for r in objs[k].reps)]:
            self.drop(key, why)
