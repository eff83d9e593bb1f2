"""The object table: every value and pending put, in recency order: `Objects`.

It owns ``objs`` (key -> `Obj`; a read moves its key to the end, so the order is the LRU order
eviction walks), each pending put's deadline (``pending``; zombie reclaim after it), and the
shared strings of sizes and owners. Its rules are the ones every component relies on: record a
placed put (`add`), commit or revoke it (`end`, `revoke`), store a value the master holds
itself (`add_inline`: ``inline``, in recency order), and `drop` an object (ranges back through
the write fence, REMOVED event, ``del`` entry). Called by `Puts`, `Reserve`, `Inline`,
`Removal`, `Eviction`, `Tasks`, `Membership` and `Replication`.
"""

from __future__ import annotations

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind
from yuebing.store.config import HELD_OVERHEAD, MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.reservations import Reservations
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import Obj, ObjState

C = m.Code
MAX_OWNERS = 1 << 16
COMMITTED = ObjState.COMMITTED
PENDING = ObjState.PENDING


class Objects:
    """``objs`` (recency order), ``pending`` (key -> deadline of a pending put), and the
    tables that let objects share their size and owner strings."""

    __slots__ = ("book", "cfg", "clock", "effects", "fence", "inline", "inline_bytes", "objs",
                 "owners", "pending", "segments", "sizes")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments, fence: WriteFence,
                 book: Reservations, effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.fence = fence
        self.book = book
        self.effects = effects
        self.objs: dict[str, Obj] = {}
        self.pending: dict[str, float] = {}
        self.sizes: dict[int, int] = {}
        self.owners: dict[str, str] = {}
        self.inline: dict[str, bytes] = {}
        """Values the master holds itself (no replicas), least recently read first."""
        self.inline_bytes = 0
        """What the held values count against ``inline_capacity`` (`HELD_OVERHEAD` each)."""

    def add(self, client: str, it: m.PutItem, placed: list[tuple[int, int]]) -> None:
        """Record the pending put of ``it`` by ``client`` on ``placed`` ranges: its deadline
        (``put_timeout_s``), its write expiry, a ``put`` replication entry."""
        now = self.clock.now()
        soft = now + it.soft_pin_s if it.soft_pin_s else 0.0
        deadline = now + self.cfg.put_timeout_s
        size = self.sizes.get(it.size)  # values of one model share a few sizes: share the ints
        if size is None:
            size = it.size
            if len(self.sizes) < 4096:
                self.sizes[size] = size
        self.objs[it.key] = Obj(size, it.checksum, tuple(placed), client, it.hard_pin, soft)
        self.pending[it.key] = deadline
        self.fence.start(it.key, now, it.timeout_s)
        self.effects.entry(["put", it.key, it.size, it.checksum, placed, client, it.hard_pin,
                            it.soft_pin_s])

    def add_inline(self, client: str, it: m.PutItem, value: bytes) -> None:
        """Store ``value`` of ``client``'s put ``it`` in the master, committed at once (one
        ``inline`` entry carries the bytes to the standbys, a STORED event names
        `INLINE_HOLDER`); ``client`` stays its owner, so a resent put answers OK."""
        now = self.clock.now()
        o = Obj(it.size, it.checksum, (), self.owner_id(client), it.hard_pin,
                now + it.soft_pin_s if it.soft_pin_s else 0.0)
        o.state = COMMITTED
        self.objs[it.key] = o
        self.inline[it.key] = value
        self.inline_bytes += len(value) + HELD_OVERHEAD
        self.effects.entry(["inline", it.key, it.size, it.checksum, value, client, it.hard_pin,
                            it.soft_pin_s])
        self.effects.events.append((EventKind.STORED, it.key, [m.INLINE_HOLDER]))
        self.effects.counters["puts"] += 1

    def touch_held(self, key: str) -> None:
        """A held value was read: it moves to the recently used end of both orders (the
        objects' and the held values', which their evictions walk from the front)."""
        self.objs[key] = self.objs.pop(key)
        self.inline[key] = self.inline.pop(key)

    def due_at_expiry(self, key: str) -> None:
        """Reclaim the pending put ``key`` at its write expiry (a reservation: useless after
        it) rather than at its deadline."""
        self.pending[key] = self.fence.expiry[key]

    def pending_of(self, client: str, key: str) -> tuple[Obj | None, str]:
        o = self.objs.get(key)
        if o is None or o.state != PENDING:
            return None, f"no pending put of {key!r}"
        if o.owner != client:
            return None, f"pending put of {key!r} belongs to another client"
        return o, ""

    def committed_by(self, client: str, key: str) -> Obj | None:
        """``key``'s object if it is COMMITTED and ``client`` committed it, else None: a
        `PutEnd` / `PutCommit` retried by the RPC layer after a lost reply finds it so."""
        o = self.objs.get(key)
        return o if o is not None and o.state == COMMITTED and o.owner == client else None

    def owner_id(self, client: str) -> str:
        """``client`` as one string shared by every object it committed (a decoded message
        brings a new string each time); the table is forgotten when it holds `MAX_OWNERS`."""
        got = self.owners.get(client)
        if got is None:
            if len(self.owners) >= MAX_OWNERS:
                self.owners.clear()
            got = self.owners[client] = client
        return got

    def end(self, client: str, key: str) -> tuple[C, str]:
        """Commit ``client``'s pending put of ``key`` (visible, immutable, a STORED event); the
        object keeps ``client`` as owner, so a retried commit answers OK."""
        o, text = self.pending_of(client, key)
        if o is None:
            if self.committed_by(client, key) is not None:
                return C.OK, ""  # a retry whose first try committed (reply lost, failover)
            return C.NOT_PENDING, text
        if key in self.book.by_key:
            return C.BAD_REQUEST, f"{key!r} is a reservation: fill it with PutCommit"
        if not o.reps:
            self.drop(key, o, event=False)
            return C.NOT_FOUND, f"every segment written for {key!r} was lost; value discarded"
        o.state = COMMITTED
        o.owner = self.owner_id(client)  # kept: a retried commit of this client answers OK
        del self.pending[key]
        self.fence.forget(key)
        self.effects.entry(["commit", key])
        segs = self.segments.segs
        self.effects.events.append((EventKind.STORED, key, [segs[s].name for s, _ in o.reps]))
        self.effects.counters["puts"] += 1
        return C.OK, ""

    def revoke(self, client: str, key: str) -> tuple[C, str]:
        """Drop ``client``'s pending put of ``key`` (its ranges wait out the write fence)."""
        o, text = self.pending_of(client, key)
        if o is None:
            return C.NOT_PENDING, text
        self.drop(key, o, event=False)
        return C.OK, ""

    def drop(self, key: str, o: Obj, event: bool = True, fenced: bool = True) -> None:
        """Forget an object and free every range it holds (a pending put's after its fence,
        unless ``fenced`` is False: a reservation no write used, `Reserve.give_back`)."""
        del self.objs[key]
        self.pending.pop(key, None)
        self.book.discard(key)
        holders = self.fence.release(key, o, fenced)
        value = self.inline.pop(key, None)
        if value is not None:
            self.inline_bytes -= len(value) + HELD_OVERHEAD
            holders.append(m.INLINE_HOLDER)
        self.effects.entry(["del", key] if fenced else ["del", key, False])
        if event and o.state == COMMITTED:
            self.effects.events.append((EventKind.REMOVED, key, holders))

    def rename(self, name: str, key: str) -> Obj:
        """Move the pending object ``name`` (a reservation) to ``key``, with its deadline and
        write expiry; ``key`` becomes the most recent."""
        o = self.objs.pop(name)
        self.objs[key] = o
        self.pending[key] = self.pending.pop(name)
        self.fence.rename(name, key)
        return o

    def segment_lost(self, sid: int, name: str) -> tuple[list[str], list[tuple[str, int, int]]]:
        """Segment ``sid`` (``name``) was unmounted: every object loses its replica there (a
        REMOVED event per committed one). Returns the committed keys left without a replica
        and not moving (to drop), and the ranges ``(key, offset, size)`` pending puts held
        there (to fence); a pending put stays until put_end/revoke/timeout."""
        dead: list[str] = []
        fenced: list[tuple[str, int, int]] = []
        events = self.effects.events
        for key, o in self.objs.items():
            if any(r[0] == sid for r in o.reps):
                if o.state == PENDING:
                    fenced.extend((key, off, o.size) for r_sid, off in o.reps if r_sid == sid)
                o.reps = tuple(r for r in o.reps if r[0] != sid)
                if o.state == COMMITTED:
                    events.append((EventKind.REMOVED, key, [name]))
                    if not o.reps and o.moving == 0:
                        dead.append(key)
        return dead, fenced

    # -------------------------------------------------------------- standby side
    def restore(self, key: str, size: int, checksum: int, reps: list, owner: str | None,
                pin: bool, soft_s: float) -> None:
        """A ``put`` entry (or snapshot row) on a standby: deadline and write expiry taken as
        late as ``put_timeout_s`` from now (no absolute times cross hosts)."""
        now = self.clock.now()
        self.objs[key] = Obj(size, checksum, tuple(tuple(r) for r in reps), owner, pin,
                             now + soft_s if soft_s else 0.0)
        self.pending[key] = until = now + self.cfg.put_timeout_s
        self.fence.set(key, until)

    def restore_inline(self, key: str, size: int, checksum: int, value: bytes,
                       owner: str | None, pin: bool, soft_s: float) -> None:
        """An ``inline`` entry (or snapshot row) on a standby: the value, committed."""
        o = Obj(size, checksum, (), owner and self.owner_id(owner), pin,
                self.clock.now() + soft_s if soft_s else 0.0)
        o.state = COMMITTED
        self.objs[key] = o
        old = self.inline.get(key)
        self.inline[key] = value
        self.inline_bytes += len(value) - (len(old) if old is not None else -HELD_OVERHEAD)

    def restore_commit(self, key: str) -> None:
        """A ``commit`` entry on a standby."""
        o = self.objs[key]
        o.state = COMMITTED
        if o.owner is not None:  # kept, shared per client, as on the leader (`end`)
            o.owner = self.owner_id(o.owner)
        self.pending.pop(key, None)
        self.fence.forget(key)

    def restart_pending(self, now: float) -> None:
        """A new leader: every pending put gets a fresh ``put_timeout_s`` from ``now`` as its
        deadline and, as late, its write expiry."""
        for key in self.pending:
            self.pending[key] = until = now + self.cfg.put_timeout_s
            self.fence.set(key, until)

    def clear(self) -> None:
        self.objs.clear()
        self.inline.clear()
        self.inline_bytes = 0
        self.pending.clear()
        self.fence.forget_all()
