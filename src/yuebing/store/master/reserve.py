"""Reservations of the master core: space allocated ahead for a client's next put, so that a
put in a stream of same-shaped values costs one RPC (`PutCommit`) instead of two.

Life of a reservation: a `PutStart` or `PutCommit` with ``reserve_next`` asks for one; `reserve`
places it like a put of the same shape (size, replicas, strategy, preferred) under an internal
key (``RESERVED_PREFIX + client/n``), from free space only (it never evicts a stored value for
room that may go unused; with no room the reply carries none), and records its shape here. It
is an ordinary pending put
otherwise, so replication, write expiry, zombie reclaim (at its write expiry: it is useless
after), session expiry and the write fence (its ranges quarantined when dropped) apply as to
any put; no probe, listing, removal, eviction or event sees pending objects. The one
exception to the fence: a reservation its client gives back unused (`give_back`, the
``unused`` keys of `BatchPutRevoke`: one it held without ever writing into it — stale, on a
failed segment, or held at close) is freed at once, since no write touched it. The client writes
the next value into it and sends `PutCommit`: `commit` checks it (pending, this client's, write
expiry not passed, same shape, key free), renames the pending object to the user's key, sets
checksum and pins, commits it like `PutEnd` and may hand out the next reservation. A retried
`PutCommit` whose first try committed (the reservation is gone, its name is in the client's
record of recent commits (`Reservations.recent`) for this very key, and the key is COMMITTED by
this client with the same size and checksum) answers `PutCommitted` again, with the client's
reservation of that shape (the one the lost reply carried, or a new one) when it asks for the
next; the commit itself is not counted, logged or announced again. Any other commit through a
gone reservation is refused, even of a key the client stored with the same size and checksum
(with checksums off, -1, that may be a different value). The record is kept wherever a rename
is applied (leader and standbys) and carried in snapshots, so a retry after failover succeeds;
it is bounded (`RECENT_PER_CLIENT` names per client, `RECENT_CLIENTS` clients), not per object.
A new leader numbers reservations from a random base (`take_over`), so a retry never meets a
new reservation under the name its first try consumed.

Batches: `BatchPutStart` / `BatchPutCommit` with ``reserve_next`` = n ask for n reservations of
the batch's shape (a client holds a list per shape), so a stream of same-shaped batches costs
one RPC per batch; `BatchPutCommit` commits each item into its reservation like `PutCommit`
(a code per item; a refused item's reservation stays). A client holds at most `MAX_SHAPES`
shapes and `MAX_PER_CLIENT` reservations: asking again for n of a shape it holds returns the
same ones first (a retried request after a lost reply leaks nothing); a new shape beyond the
cap gets none, and no more than the cap are placed. The master never drops a client's
reservation to make room for another (it cannot know whether a write into it is under way,
so its space would wait out the fence unused); the client gives its stale ones back unused.
A reservation on a segment that starts draining
or loses a replica to an unmount is dropped (its next commit is refused, the client falls back
to the two-phase put). Replication: ``["resv", key, replicas, strategy, preferred]`` after its
``put`` entry, ``["rename", reservation, key, checksum, hard_pin, soft_pin_s]`` before the
``commit`` entry (`replication.apply_entries`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from yuebing.store import messages as m
from yuebing.store.master.state import ObjState

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
C = m.Code
PREFIX = m.RESERVED_PREFIX
MAX_SHAPES = 4
"""Shapes a client holds reservations of (its oldest shape's are dropped for a new one)."""
MAX_PER_CLIENT = 64
"""Reservations a client holds in all (a batch of more items reserves this many)."""
RECENT_PER_CLIENT = 64
"""Consumed reservation names remembered per client (a retry comes within a few puts)."""
RECENT_CLIENTS = 1024
"""Clients with such a record; the one that committed least recently is forgotten first."""

Shape = tuple[int, int, str, tuple[str, ...]]
"""(size, replicas, strategy, preferred) of a `PutItem`: what a reservation was placed for."""


def shape_of(it: m.PutItem) -> Shape:
    return (it.size, it.replicas, it.strategy, tuple(it.preferred))


class Reservations:
    """The shapes and owners of the core's reservations (their objects live in ``core.objs``
    under their keys). ``by_client`` maps a client to its reservations per shape (shapes and
    keys oldest first);
    ``recent`` maps a client to the names of its last consumed reservations and the key each
    one's commit stored (oldest first; clients in the order they last committed)."""

    __slots__ = ("by_client", "by_key", "recent", "seq")

    def __init__(self) -> None:
        self.by_key: dict[str, tuple[str, Shape]] = {}
        self.by_client: dict[str, dict[Shape, list[str]]] = {}
        self.recent: dict[str, dict[str, str]] = {}
        self.seq = 0

    def __len__(self) -> int:
        return len(self.by_key)

    def add(self, key: str, client: str, shape: Shape) -> None:
        self.by_key[key] = (client, shape)
        self.by_client.setdefault(client, {}).setdefault(shape, []).append(key)

    def held(self, client: str, shape: Shape) -> list[str]:
        """``client``'s reservations of ``shape``, oldest first (a copy)."""
        return list(self.by_client.get(client, {}).get(shape, ()))

    def count(self, client: str) -> int:
        return sum(len(keys) for keys in self.by_client.get(client, {}).values())

    def discard(self, key: str) -> None:
        """Forget ``key`` (called by the core whenever it drops or renames a pending object)."""
        got = self.by_key.pop(key, None)
        if got is None:
            return
        client, shape = got
        mine = self.by_client.get(client)
        keys = mine.get(shape) if mine is not None else None
        if keys is not None and key in keys:
            keys.remove(key)
            if not keys:
                del mine[shape]  # type: ignore[union-attr]
                if not mine:
                    del self.by_client[client]

    def consumed(self, client: str, name: str, key: str) -> None:
        """Note that ``client``'s reservation ``name`` was renamed to ``key`` (`_rename`, on the
        leader and on standbys; `load_recent` from a snapshot)."""
        mine = self.recent.pop(client, None)  # re-inserted: the most recent client last
        if mine is None:
            if len(self.recent) >= RECENT_CLIENTS:
                del self.recent[next(iter(self.recent))]
            mine = {}
        elif len(mine) >= RECENT_PER_CLIENT:
            del mine[next(iter(mine))]
        mine[name] = key
        self.recent[client] = mine

    def consumed_for(self, client: str, name: str) -> str | None:
        """The key ``client``'s reservation ``name`` was committed to, if it is remembered."""
        mine = self.recent.get(client)
        return None if mine is None else mine.get(name)

    def clear(self) -> None:
        self.by_key.clear()
        self.by_client.clear()
        self.recent.clear()

    def dump(self) -> list[list[Any]]:
        """Snapshot rows ``[key, replicas, strategy, preferred]`` (owner and size are the
        object's)."""
        return [[k, s[1], s[2], list(s[3])] for k, (_, s) in self.by_key.items()]

    def dump_recent(self) -> list[list[Any]]:
        """Snapshot rows ``[client, [[name, key], ...]]`` of ``recent``, in its order."""
        return [[c, [[n, k] for n, k in mine.items()]] for c, mine in self.recent.items()]

    def load_recent(self, rows: list[list[Any]]) -> None:
        """Replace ``recent`` with `dump_recent`'s rows (`replication.load_snapshot`)."""
        self.recent.clear()
        for client, pairs in rows:
            for name, key in pairs:
                self.consumed(client, name, key)


def check_key(key: str) -> str:
    """The refusal for a user key in the reserved namespace ('' when the key is fine)."""
    if key.startswith(PREFIX):
        return f"keys starting with {PREFIX!r} are reserved for the store's own reservations"
    return ""


def check_reserve_next(n: int) -> str:
    """The refusal for a batch's ``reserve_next`` ('' when fine; above the cap it is capped)."""
    return f"reserve_next must be >= 0, got {n}" if n < 0 else ""


def reserve(core: MasterCore, client: str, item: m.PutItem) -> m.Reservation | None:
    """A reservation of ``item``'s shape for ``client`` (its oldest one of that shape, or a
    new one); None when there is no room (the next put then goes the two-phase way)."""
    got = reserve_many(core, client, item, 1)
    return got[0] if got else None


def reserve_many(core: MasterCore, client: str, item: m.PutItem, n: int) -> list[m.Reservation]:
    """Up to ``n`` (at most `MAX_PER_CLIENT`) reservations of ``item``'s shape for ``client``:
    the ones it holds of that shape first, then new ones while there is free room and the
    client is within its caps: a new shape beyond `MAX_SHAPES` gets none, and so do ``n``
    that the cap on reservations in all would cut short (a batch can only use n)."""
    rs: Reservations = core.reservations
    shape = shape_of(item)
    n = max(0, min(n, MAX_PER_CLIENT))
    keys = rs.held(client, shape)
    count = rs.count(client)
    if (not keys and len(rs.by_client.get(client, {})) >= MAX_SHAPES) \
            or count + n - len(keys) > MAX_PER_CLIENT:
        n = min(n, len(keys))
    while len(keys) < n:
        key = _new_key(core, client)
        resv = m.PutItem(key=key, size=item.size, replicas=item.replicas, strategy=item.strategy,
                         preferred=item.preferred, timeout_s=item.timeout_s)
        code, _ = core._put_one(client, resv, internal=True)
        if code != C.OK:
            break
        rs.add(key, client, shape)
        core.pending[key] = core.expiry[key]  # useless after its write expiry: reclaimed then
        core._log(["resv", key, item.replicas, item.strategy, list(item.preferred)])
        core.counters["reservations_made"] += 1
        keys.append(key)
        count += 1
    segs, objs, expiry, now = core.segs, core.objs, core.expiry, core.clock.now()
    return [m.Reservation(key=key, replicas=[m.Replica(segment=segs[s].name, offset=off)
                                             for s, off in objs[key].reps],
                          expires_in_s=max(0.0, expiry[key] - now))  # as `fence.expires_in`
            for key in keys[:n]]


def one_shape(items: list[m.PutItem]) -> bool:
    """Whether ``items`` (at least one) all have one shape (reservations are per shape)."""
    if not items:
        return False
    first = shape_of(items[0])
    return all(shape_of(it) == first for it in items[1:])


def _new_key(core: MasterCore, client: str) -> str:
    rs: Reservations = core.reservations
    while True:  # a new leader restarts the sequence: skip keys its predecessor used
        rs.seq += 1
        key = f"{PREFIX}{client}/{rs.seq}"
        if key not in core.objs:
            return key


def commit(core: MasterCore, msg: m.PutCommit) -> m.Message:
    """Handle `PutCommit` (see the module docstring); a refusal changes nothing except that an
    expired reservation is dropped."""
    code, text = _commit_one(core, msg.client, msg.reservation, msg.item)
    if code != C.OK:
        return m.Err(code=int(code), message=text)
    return m.PutCommitted(reservation=reserve(core, msg.client, msg.item)
                          if msg.reserve_next else None)


def batch_commit(core: MasterCore, msg: m.BatchPutCommit) -> m.Message:
    """Handle `BatchPutCommit`: each item as a `PutCommit` into its reservation, then (asked,
    and the items of one shape) the next batch's reservations."""
    problem = check_reserve_next(msg.reserve_next)
    if not msg.items:
        problem = "a batch commit needs at least one item"
    elif len(msg.reservations) != len(msg.items):
        problem = f"{len(msg.reservations)} reservations for {len(msg.items)} items"
    if problem:
        return m.Err(code=C.BAD_REQUEST, message=problem)
    codes = [int(_commit_one(core, msg.client, name, it)[0])
             for name, it in zip(msg.reservations, msg.items, strict=True)]
    nxt = reserve_many(core, msg.client, msg.items[0], msg.reserve_next) \
        if msg.reserve_next > 0 and one_shape(msg.items) else []
    return m.BatchPutCommitted(codes=codes, reservations=nxt)


def _commit_one(core: MasterCore, client: str, name: str, it: m.PutItem) -> tuple[C, str]:
    """Store ``it`` through ``client``'s reservation ``name``: (OK, "") — also for a retry
    whose first try committed (reply lost, failover) — or the refusal, which changes nothing
    except that an expired reservation is dropped."""
    problem = core._check_item(it) or check_key(it.key)
    if problem:
        return C.BAD_REQUEST, problem
    key = it.key
    got = core.reservations.by_key.get(name)
    o = core.objs.get(name)
    if got is None or o is None or o.state != ObjState.PENDING:
        done = core.committed_by(client, key)
        if (done is not None and (done.size, done.checksum) == (it.size, it.checksum)
                and (it.checksum != -1  # same bytes (w.h.p.): answering OK changes nothing
                     or core.reservations.consumed_for(client, name) == key)):
            return C.OK, ""  # the caller's `reserve` returns the next one it may have placed
        return C.NOT_PENDING, (f"no reservation {name!r} (revoked, expired, reclaimed or "
                               "already used); put the value again")
    if got[0] != client:
        return C.NOT_PENDING, f"reservation {name!r} belongs to another client"
    now = core.clock.now()
    late = now - core.expiry.get(name, now)
    if late > 0:
        drop(core, name, "write expiry passed")
        return C.NOT_PENDING, (f"reservation {name!r} passed its write expiry {late:.3f}s ago; "
                               "put the value again")
    if shape_of(it) != got[1]:
        return C.BAD_REQUEST, (f"reservation {name!r} was placed for (size, replicas, strategy, "
                               f"preferred) = {got[1]}, not {shape_of(it)}")
    if key in core.objs:
        return C.EXISTS, f"key {key!r} exists (values are immutable)"
    _rename(core, name, key, it)
    code, text = core._end_one(client, key)
    if code != C.OK:
        return code, text
    core.counters["reservations_committed"] += 1
    return C.OK, ""


def _rename(core: MasterCore, name: str, key: str, it: m.PutItem) -> None:
    o = core.objs.pop(name)
    core.reservations.discard(name)
    if o.owner is not None:
        core.reservations.consumed(o.owner, name, key)
    o.checksum = it.checksum
    o.pin = it.hard_pin
    o.soft = core.clock.now() + it.soft_pin_s if it.soft_pin_s else 0.0
    core.objs[key] = o
    core.pending[key] = core.pending.pop(name)
    if name in core.expiry:
        core.expiry[key] = core.expiry.pop(name)
    core._log(["rename", name, key, it.checksum, it.hard_pin, it.soft_pin_s])


def apply_rename(core: MasterCore, e: list[Any]) -> None:
    """Standby side of a ``rename`` entry (`replication`)."""
    _, name, key, checksum, pin, soft_s = e
    _rename(core, name, key, m.PutItem(key=key, size=1, checksum=checksum, hard_pin=pin,
                                       soft_pin_s=soft_s))


def apply_resv(core: MasterCore, e: list[Any]) -> None:
    """Standby side of a ``resv`` entry (also a snapshot row with the tag in front)."""
    _, key, replicas, strategy, preferred = e
    o = core.objs[key]
    assert o.owner is not None
    core.reservations.add(key, o.owner, (o.size, replicas, strategy, tuple(preferred)))


def drop(core: MasterCore, key: str, why: str) -> None:
    """Give a reservation up (its ranges wait out the write fence); its next commit is refused."""
    o = core.objs.get(key)
    if o is not None and o.state == ObjState.PENDING:
        log.info("reservation %s dropped: %s", key, why)
        core._drop(key, o, event=False)


def give_back(core: MasterCore, client: str, keys: list[str]) -> list[int]:
    """``client`` gives back its reservations ``keys`` unused (it never wrote into them nor
    will): each is freed at once, not fenced. A code per key: NOT_PENDING for a key that is
    not a pending reservation of ``client`` (gone already — nothing to do)."""
    out: list[int] = []
    for key in keys:
        got = core.reservations.by_key.get(key)
        o = core.objs.get(key)
        if got is None or got[0] != client or o is None or o.state != ObjState.PENDING:
            out.append(int(C.NOT_PENDING))
            continue
        core._drop(key, o, event=False, fenced=False)
        core.counters["reservations_returned"] += 1
        out.append(int(C.OK))
    return out


def drop_on_segment(core: MasterCore, sid: int, why: str) -> None:
    """Drop every reservation with a replica on segment ``sid`` (draining or unmounted)."""
    objs = core.objs
    for key in [k for k in core.reservations.by_key
                if k in objs and any(r[0] == sid for r in objs[k].reps)]:
        drop(core, key, why)
