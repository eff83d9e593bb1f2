"""The master's metadata core: a single-threaded state machine over plain dicts.

Life of a value here: ``put_start`` validates the request, places replicas on distinct DRAM
segments (`placement`), allocates their ranges (`allocator`) and records a PENDING object that
no reader can see; the client writes the bytes through the transfer engine, then ``put_end``
commits it (visible, immutable, a STORED event; the object keeps its committing client as
``owner``, so a commit retried after a lost reply answers OK) or ``put_revoke`` frees it.
Reads (``get_replicas``: DRAM replicas and a read lease) and probes are `reads`' handlers,
removal and pins `removal`'s, reservations (one-RPC puts) `reserve`'s.
Eviction, tiering and sessions live in `eviction` and `segments`; the RPC adapter is `service`.

The core never does I/O: it reads time from a `Clock`, and leaves work for its adapter in
``events`` (KV events), ``log`` (replication entries), ``outbox`` (node tasks) and ``ready``
(deferred replies). Handlers return a reply message, or None when the reply is deferred.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from functools import partial
from typing import Any

from yuebing.core.clock import Clock, WallClock
from yuebing.protocol import Message
from yuebing.store import messages as m
from yuebing.store.cluster_messages import Drain, EventKind, Mount, NodeTask, TaskDone, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master import eviction, fence, fit, migration, reads, removal, reserve, segments
from yuebing.store.master.incarnations import heartbeat as node_heartbeat
from yuebing.store.master.leases import Leases, release, sweep
from yuebing.store.master.placement import PLACEMENTS, PlacementRequest
from yuebing.store.master.state import Obj, ObjState, Seg, SegState, Session, Task

log = logging.getLogger(__name__)

C = m.Code
MAX_KEY = 4096
MAX_REPLICAS = 16
MAX_OWNERS = 1 << 16
COMMITTED = ObjState.COMMITTED
PENDING = ObjState.PENDING


def err(code: C, message: str) -> m.Err:
    return m.Err(code=int(code), message=message)


class MasterCore:
    """All metadata of one store cluster. Not thread-safe: one caller at a time."""

    def __init__(self, cfg: MasterConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock or WallClock()
        self.rng = random.Random(cfg.seed)
        self.objs: dict[str, Obj] = {}
        self.pending: dict[str, float] = {}
        self.expiry: dict[str, float] = {}
        """Write expiry of each pending put (`fence`)."""
        self.quarantine = fence.Quarantine()
        self.reservations = reserve.Reservations()
        self.segs: dict[int, Seg] = {}
        self.seg_by_name: dict[str, int] = {}
        self.sessions: dict[str, Session] = {}
        self.tasks: dict[int, Task] = {}
        self.drains = migration.Drains()
        self.leases = Leases()
        self.parked: list[fit.Parked] = []
        """Puts waiting for room (`fit`)."""
        self.room_wait = False
        self.fit_size = 0
        self.fit_until = 0.0
        self._sizes: dict[int, int] = {}
        self._owners: dict[str, str] = {}
        self.next_seg = 1
        self.next_task = 1
        self.events: list[tuple[int, str, list[str]]] = []
        self.log: list[list[Any]] | None = None
        self.outbox: list[tuple[str, NodeTask]] = []
        self.ready: list[tuple[object, Message]] = []
        self.counters: dict[str, int] = dict.fromkeys(
            ("puts", "gets", "removes", "evictions", "offloads", "promotions", "zombies",
             "dead_sessions", "no_space", "suspects", "migrations_started", "migrations_done",
             "migrations_failed", "migrations_given_up", "quarantined", "reservations_made",
             "reservations_committed", "reservations_expired", "reservations_returned"), 0)
        self.handlers: dict[type, Callable[..., Message | None]] = {
            m.PutStart: self.put_start, m.PutEnd: self.put_end, m.PutRevoke: self.put_revoke,
            m.PutCommit: self.put_commit, m.BatchPutCommit: partial(reserve.batch_commit, self),
            m.BatchPutStart: self.batch_put_start, m.BatchPutEnd: self.batch_put_end,
            m.BatchPutRevoke: self.batch_put_revoke,
            m.GetReplicas: partial(reads.get_replicas, self),
            m.BatchGetReplicas: partial(reads.batch_get_replicas, self),
            m.Exists: partial(reads.exists, self), m.ReleaseLeases: partial(release, self),
            m.BatchExists: partial(reads.batch_exists, self),
            m.PrefixMatch: partial(reads.prefix_match, self),
            m.Remove: partial(removal.remove, self),
            m.BatchRemove: partial(removal.batch_remove, self),
            m.RemovePrefix: partial(removal.remove_prefix, self),
            m.RemoveAll: partial(removal.remove_all, self), m.Pin: partial(removal.pin, self),
            Mount: self.mount, Unmount: self.unmount, Drain: self.drain,
            m.Heartbeat: self.heartbeat, TaskDone: self.task_done, m.GetStats: self.stats,
        }

    # ------------------------------------------------------------------ dispatch
    def handle(self, msg: Message, waiter: object = None, ident: bytes | None = None) -> Message | None:
        """Apply one request. ``waiter`` identifies the caller for a deferred reply; ``ident`` is
        its transport identity (kept for sessions so the master can push node tasks)."""
        h = self.handlers.get(type(msg))
        if h is None:
            return err(C.BAD_REQUEST, f"{type(msg).__name__} is not a master request")
        client = getattr(msg, "client", None)
        if client is not None:
            self.touch_session(client, ident)
        t = type(msg)
        if t is m.GetReplicas:
            return reads.get_replicas(self, msg, waiter)  # type: ignore[arg-type]
        if waiter is not None and (t is m.PutStart or t is m.BatchPutStart):
            return fit.first_try(self, msg, waiter)  # may wait for room
        return h(msg)

    def touch_session(self, client: str, ident: bytes | None) -> Session:
        s = self.sessions.get(client)
        deadline = self.clock.now() + self.cfg.client_ttl_s
        if s is None:
            s = self.sessions[client] = Session(deadline, ident)
        else:
            s.deadline = deadline
            if ident is not None:
                s.ident = ident
        return s

    def _log(self, entry: list[Any]) -> None:
        if self.log is not None:
            self.log.append(entry)

    # ------------------------------------------------------------------ put
    def put_start(self, msg: m.PutStart) -> Message:
        code, reps = self._put_one(msg.client, msg.item)
        if code != C.OK:
            return err(code, reps)  # type: ignore[arg-type]
        expires_in_s = fence.expires_in(self, [msg.item.key])
        nxt = reserve.reserve(self, msg.client, msg.item) if msg.reserve_next else None
        return m.PutTargets(key=msg.item.key, replicas=reps,  # type: ignore[arg-type]
                            expires_in_s=expires_in_s, reservation=nxt)

    def put_commit(self, msg: m.PutCommit) -> Message:
        """One-RPC put into a reservation (`reserve.commit`)."""
        return reserve.commit(self, msg)

    def batch_put_start(self, msg: m.BatchPutStart) -> Message:
        problem = reserve.check_reserve_next(msg.reserve_next) or (
            "" if msg.items else "a batch put needs at least one item")
        if problem:
            return err(C.BAD_REQUEST, problem)
        codes: list[int] = []
        out: list[list[m.Replica]] = []
        for item in msg.items:
            code, reps = self._put_one(msg.client, item)
            codes.append(int(code))
            out.append(reps if code == C.OK else [])  # type: ignore[arg-type]
        placed = [it.key for it, c in zip(msg.items, codes, strict=True) if c == C.OK]
        nxt = reserve.reserve_many(self, msg.client, msg.items[0], msg.reserve_next) \
            if msg.reserve_next > 0 and reserve.one_shape(msg.items) else []
        return m.BatchPutTargets(codes=codes, replicas=out,
                                 expires_in_s=fence.expires_in(self, placed), reservations=nxt)

    def _check_item(self, it: m.PutItem) -> str:
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

    def _put_one(self, client: str, it: m.PutItem,
                 internal: bool = False) -> tuple[C, list[m.Replica] | str]:
        """Place and allocate a pending put (``internal``: a reservation of `reserve`, placed
        from free space only: no eviction for it, and no room is not counted as ``no_space``)."""
        problem = self._check_item(it) or ("" if internal else reserve.check_key(it.key))
        if problem:
            return C.BAD_REQUEST, problem
        o = self.objs.get(it.key)
        if o is not None:
            if o.state == PENDING and o.owner == client and o.size == it.size:
                # the same client retrying after a lost reply (e.g. failover): same targets
                return C.OK, [m.Replica(segment=self.segs[s].name, offset=off) for s, off in o.reps]
            return C.EXISTS, f"key {it.key!r} exists (values are immutable)"
        need = it.min_replicas or it.replicas
        placed = self._place(client, it, need)
        if not placed and not internal and self._active_dram() >= need:
            placed = fit.place(self, client, it, need)  # evicts one contiguous range
        if not placed:
            self.counters["no_space"] += not internal
            return C.NO_SPACE, self._no_room(it, need)
        now = self.clock.now()
        soft = now + it.soft_pin_s if it.soft_pin_s else 0.0
        deadline = now + self.cfg.put_timeout_s
        size = self._sizes.get(it.size)  # values of one model share a few sizes: share the ints
        if size is None:
            size = it.size
            if len(self._sizes) < 4096:
                self._sizes[size] = size
        self.objs[it.key] = Obj(size, it.checksum, tuple(placed), client, it.hard_pin, soft)
        self.pending[it.key] = deadline
        self.expiry[it.key] = fence.write_expiry(self, now, it.timeout_s)
        self._log(["put", it.key, it.size, it.checksum, placed, client, it.hard_pin, it.soft_pin_s])
        segs = self.segs
        return C.OK, [m.Replica(segment=segs[s].name, offset=o) for s, o in placed]

    def _place(self, client: str, it: m.PutItem, least: int) -> list[tuple[int, int]]:
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

    def _active_dram(self) -> int:
        return sum(1 for s in self.segs.values()
                   if s.tier == m.Tier.DRAM and s.state == 0 and s.alloc is not None)

    def _no_room(self, it: m.PutItem, need: int) -> str:
        """Why a put needing ``need`` replicas could not be placed (the NO_SPACE message)."""
        if need == 1:
            return f"no DRAM segment has {it.size} free bytes"
        active = self._active_dram()
        what = (f"only {active} DRAM segments take puts" if active < need else
                f"fewer than {need} of the {active} DRAM segments have {it.size} free bytes")
        return (f"{it.key!r} needs {need} replicas on distinct DRAM segments but {what} "
                "(put with best_effort to accept fewer)")

    def put_end(self, msg: m.PutEnd) -> Message:
        code, text = self._end_one(msg.client, msg.key)
        return m.Ok() if code == C.OK else err(code, text)

    def batch_put_end(self, msg: m.BatchPutEnd) -> Message:
        return m.Codes(codes=[int(self._end_one(msg.client, k)[0]) for k in msg.keys])

    def _pending_of(self, client: str, key: str) -> tuple[Obj | None, str]:
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
        got = self._owners.get(client)
        if got is None:
            if len(self._owners) >= MAX_OWNERS:
                self._owners.clear()
            got = self._owners[client] = client
        return got

    def _end_one(self, client: str, key: str) -> tuple[C, str]:
        o, text = self._pending_of(client, key)
        if o is None:
            if self.committed_by(client, key) is not None:
                return C.OK, ""  # a retry whose first try committed (reply lost, failover)
            return C.NOT_PENDING, text
        if key in self.reservations.by_key:
            return C.BAD_REQUEST, f"{key!r} is a reservation: fill it with PutCommit"
        if not o.reps:
            self._drop(key, o, event=False)
            return C.NOT_FOUND, f"every segment written for {key!r} was lost; value discarded"
        o.state = COMMITTED
        o.owner = self.owner_id(client)  # kept: a retried commit of this client answers OK
        del self.pending[key]
        self.expiry.pop(key, None)
        self._log(["commit", key])
        self.events.append((EventKind.STORED, key, [self.segs[s].name for s, _ in o.reps]))
        self.counters["puts"] += 1
        return C.OK, ""

    def put_revoke(self, msg: m.PutRevoke) -> Message:
        self._suspect(msg.failed)
        code, text = self._revoke_one(msg.client, msg.key)
        return m.Ok() if code == C.OK else err(code, text)

    def batch_put_revoke(self, msg: m.BatchPutRevoke) -> Message:
        self._suspect(msg.failed)
        codes = [int(self._revoke_one(msg.client, k)[0]) for k in msg.keys]
        return m.Codes(codes=codes + reserve.give_back(self, msg.client, msg.unused))

    def _suspect(self, names: list[str]) -> None:
        """A client could not write to these segments: place nothing there until their node
        heartbeats again (a dead node's segment would otherwise take puts until its TTL)."""
        for name in names:
            sid = self.seg_by_name.get(name)
            s = self.segs.get(sid) if sid is not None else None
            if s is not None and s.state == SegState.ACTIVE:
                s.state = SegState.SUSPECT
                self.counters["suspects"] += 1
                log.warning("segment %s suspected dead after a failed write", name)

    def _revoke_one(self, client: str, key: str) -> tuple[C, str]:
        o, text = self._pending_of(client, key)
        if o is None:
            return C.NOT_PENDING, text
        self._drop(key, o, event=False)
        return C.OK, ""

    # ------------------------------------------------------------------ drop
    def _drop(self, key: str, o: Obj, event: bool = True, fenced: bool = True) -> None:
        """Forget an object and free every range it holds (a pending put's after its fence,
        unless ``fenced`` is False: a reservation no write used, `reserve.give_back`)."""
        del self.objs[key]
        self.pending.pop(key, None)
        self.reservations.discard(key)
        holders = fence.release(self, key, o, fenced)
        self._log(["del", key] if fenced else ["del", key, False])
        if event and o.state == COMMITTED:
            self.events.append((EventKind.REMOVED, key, holders))

    # ------------------------------------------------------------------ segments / sessions
    def mount(self, msg: Mount) -> Message:
        return segments.mount(self, msg)

    def unmount(self, msg: Unmount) -> Message:
        return segments.unmount(self, msg)

    def drain(self, msg: Drain) -> Message:
        return segments.drain(self, msg)

    def heartbeat(self, msg: m.Heartbeat) -> Message:
        return node_heartbeat(self, msg)

    def task_done(self, msg: TaskDone) -> Message:
        segments.task_done(self, msg)
        fit.retry(self)  # an offload may have made room for a waiting put
        return m.Ok()

    def tick(self) -> None:
        """Housekeeping, called every ``tick_s`` by the adapter."""
        self.quarantine.release_due(self.clock.now(), self.segs)
        segments.expire_sessions(self)
        sweep(self)  # leases that expired unreleased
        segments.reclaim_zombies(self)
        eviction.watermark(self)
        fit.keep_fit(self)
        fit.retry(self)
        eviction.drain(self)
        migration.pump(self)

    def stats(self, msg: m.GetStats | None = None) -> m.Stats:
        values = segments.usage(self)
        values["quarantined_bytes"] = float(self.quarantine.bytes(self.segs))
        return m.Stats(values=values)
