"""The master's metadata core: `MasterCore` composes the components and dispatches messages.

It owns no metadata itself: each concern is a component that owns its state (segments,
sessions, the write fence, the reservation book, objects, leases, node tasks, migrations,
eviction, tiers, puts, held values, reservations, reads, removal, membership, replication), and `handle`
routes each request to its owner. The core never does I/O: it reads time from a `Clock`, and
leaves KV events, replication entries, node tasks and deferred replies in `Effects` for its
adapter, `MasterService`, which also calls `tick` every ``tick_s``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from yuebing.core.clock import Clock, WallClock
from yuebing.protocol import Message
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, Landed, Mount, NodeTask, TaskDone, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.eviction import Eviction
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.inline import Inline
from yuebing.store.master.leases import Leases
from yuebing.store.master.membership import Membership
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.puts import Puts, err
from yuebing.store.master.reads import Reads
from yuebing.store.master.removal import Removal
from yuebing.store.master.replication import Replication
from yuebing.store.master.reservations import Reservations
from yuebing.store.master.reserve import Reserve, check_reserve_next, one_shape
from yuebing.store.master.segments import Segments
from yuebing.store.master.sessions import Sessions
from yuebing.store.master.state import Obj, Seg
from yuebing.store.master.tasks import Tasks
from yuebing.store.master.tiers import Tiers

C = m.Code


class MasterCore:
    """All metadata of one store cluster, as components. Not thread-safe: one caller at a
    time."""

    def __init__(self, cfg: MasterConfig, clock: Clock | None = None) -> None:
        self.cfg = cfg
        self.clock = clock = clock or WallClock()
        self.rng = random.Random(cfg.seed)
        self.effects = fx = Effects()
        self.segments = Segments(cfg, self.rng, fx)
        self.sessions = Sessions(cfg, clock, self.segments, fx)
        self.fence = WriteFence(cfg, clock, self.segments, fx)
        self.reservations = Reservations()
        self.objects = Objects(cfg, clock, self.segments, self.fence, self.reservations, fx)
        self.leases = Leases(cfg, clock, self.objects)
        self.tasks = Tasks(cfg, clock, self.segments, self.objects, self.fence, fx)
        self.migrations = Migrations(cfg, clock, self.rng, self.segments, self.objects,
                                     self.tasks, self.leases, fx)
        self.eviction = Eviction(cfg, clock, self.segments, self.objects, self.tasks,
                                 self.fence, self.migrations, fx)
        self.tiers = Tiers(cfg, clock, self.segments, self.objects, self.tasks, self.leases,
                           self.migrations, self.eviction, fx)
        self.puts = Puts(cfg, clock, self.segments, self.objects, self.eviction,
                         self.reservations, fx)
        self.inline = Inline(cfg, clock, self.objects, self.puts, fx)
        self.reserve = Reserve(cfg, clock, self.reservations, self.objects, self.puts, fx)
        self.reads = Reads(cfg, clock, self.objects, self.leases, self.migrations, self.tiers, fx)
        self.removal = Removal(cfg, clock, self.objects, fx)
        self.membership = Membership(cfg, clock, self.segments, self.sessions, self.objects,
                                     self.fence, self.tasks, self.migrations, self.tiers,
                                     self.reserve, fx)
        self.replication = Replication(cfg, clock, fx, self.segments, self.sessions,
                                       self.objects, self.fence, self.reservations,
                                       self.reserve, self.tasks, self.leases, self.migrations,
                                       self.membership)
        puts, reads, removal, member = self.puts, self.reads, self.removal, self.membership
        self.probes: dict[type, Callable[..., Message]] = {
            m.Exists: reads.exists, m.BatchExists: reads.batch_exists,
            m.PrefixMatch: reads.prefix_match}
        """Read-only requests of no client session, changing nothing (no entry, no event):
        `MasterService` answers them without the dispatch of `handle`."""
        self.direct: dict[type, Callable[..., Message]] = {m.Remove: removal.remove}
        """Requests of no client session answered at once (never deferred): `MasterService`
        skips the dispatch of `handle` for them too; their entries and events go out as any."""
        self.handlers: dict[type, Callable[..., Message | None]] = {
            m.PutStart: self.put_start, m.PutEnd: puts.put_end, m.PutRevoke: puts.put_revoke,
            m.PutCommit: self.reserve.commit, m.BatchPutCommit: self.reserve.batch_commit,
            m.PutInline: self.inline.put, m.BatchPutInline: self.inline.batch_put,
            m.BatchPutStart: self.batch_put_start, m.BatchPutEnd: puts.batch_put_end,
            m.BatchPutRevoke: self.batch_put_revoke,
            m.GetReplicas: reads.get_replicas, m.BatchGetReplicas: reads.batch_get_replicas,
            m.ReleaseLeases: self.leases.release, **self.probes,
            m.Remove: removal.remove, m.BatchRemove: removal.batch_remove,
            m.RemovePrefix: removal.remove_prefix, m.RemoveAll: removal.remove_all,
            m.Pin: removal.pin,
            Mount: member.mount, Unmount: member.unmount, Drain: member.drain,
            m.Heartbeat: self.sessions.heartbeat, TaskDone: self.task_done, Landed: self.landed,
            m.GetStats: self.stats,
        }

    # -------------------------------------------------------------- what adapters read
    @property
    def objs(self) -> dict[str, Obj]:
        return self.objects.objs

    @property
    def segs(self) -> dict[int, Seg]:
        return self.segments.segs

    @property
    def seg_by_name(self) -> dict[str, int]:
        return self.segments.by_name

    @property
    def counters(self) -> dict[str, int]:
        return self.effects.counters

    @property
    def events(self) -> list[tuple[int, str, list[str]]]:
        return self.effects.events

    @events.setter
    def events(self, value: list[tuple[int, str, list[str]]]) -> None:
        self.effects.events = value

    @property
    def log(self) -> list[list[Any]] | None:
        """Replication entries not yet published (None: a standby, which logs nothing)."""
        return self.effects.log

    @log.setter
    def log(self, value: list[list[Any]] | None) -> None:
        self.effects.log = value

    @property
    def outbox(self) -> list[tuple[str, NodeTask]]:
        return self.effects.outbox

    @property
    def ready(self) -> list[tuple[object, Message]]:
        return self.effects.ready

    # -------------------------------------------------------------- dispatch
    def handle(self, msg: Message, waiter: object = None, ident: bytes | None = None) -> Message | None:
        """Apply one request. ``waiter`` identifies the caller for a deferred reply; ``ident`` is
        its transport identity (kept for sessions so the master can push node tasks)."""
        t = type(msg)
        if t is m.ConnName:  # one-way; about the connection, so not a handler's
            self.sessions.name_conn(msg.client, msg.conn, ident)  # type: ignore[attr-defined]
            return None
        h = self.handlers.get(t)
        if h is None:
            return err(C.BAD_REQUEST, f"{t.__name__} is not a master request")
        client = getattr(msg, "client", None)
        if client is not None:
            self.sessions.touch(client, ident)
        if t is m.GetReplicas:
            return self.reads.get_replicas(msg, waiter)  # type: ignore[arg-type]
        if waiter is not None and (t is m.PutStart or t is m.BatchPutStart):
            return self.puts.first_try(msg, waiter, h)  # may wait for room
        return h(msg)

    def put_start(self, msg: m.PutStart) -> Message:
        code, reps = self.puts.put_one(msg.client, msg.item)
        if code != C.OK:
            return err(code, reps)  # type: ignore[arg-type]
        expires_in_s = self.fence.expires_in([msg.item.key])
        nxt = self.reserve.reserve(msg.client, msg.item) if msg.reserve_next else None
        return m.PutTargets(key=msg.item.key, replicas=reps,  # type: ignore[arg-type]
                            expires_in_s=expires_in_s, reservation=nxt)

    def batch_put_start(self, msg: m.BatchPutStart) -> Message:
        problem = check_reserve_next(msg.reserve_next) or (
            "" if msg.items else "a batch put needs at least one item")
        if problem:
            return err(C.BAD_REQUEST, problem)
        codes: list[int] = []
        out: list[list[m.Replica]] = []
        put_one = self.puts.put_one
        for item in msg.items:
            code, reps = put_one(msg.client, item)
            codes.append(int(code))
            out.append(reps if code == C.OK else [])  # type: ignore[arg-type]
        placed = [it.key for it, c in zip(msg.items, codes, strict=True) if c == C.OK]
        nxt = self.reserve.reserve_many(msg.client, msg.items[0], msg.reserve_next) \
            if msg.reserve_next > 0 and one_shape(msg.items) else []
        return m.BatchPutTargets(codes=codes, replicas=out,
                                 expires_in_s=self.fence.expires_in(placed), reservations=nxt)

    def batch_put_revoke(self, msg: m.BatchPutRevoke) -> Message:
        """Revoke ``msg.keys`` (a reservation whose commit landed with its write answers
        COMMITTED: `Reserve.landed_already`) and give back ``msg.unused``."""
        codes = self.puts.revoke_many(msg.client, msg.keys, msg.failed)
        landed = self.reserve.landed_already
        codes = [int(C.COMMITTED) if c == C.NOT_PENDING and landed(msg.client, k) else c
                 for c, k in zip(codes, msg.keys, strict=True)]
        return m.Codes(codes=codes + self.reserve.give_back(msg.client, msg.unused))

    def landed(self, msg: Landed) -> None:
        """A node's `Landed` (one-way: no reply to the node). The client's commit is applied
        (`Reserve.commit_landed`) only when the node is the current process holding the
        segment and the client named the connection ``msg.conn`` (`m.ConnName`) to answer on;
        the answer — `PutCommitted` or the refusal — goes to that connection as request
        ``msg.rid``. Anything else is ignored and counted: the client, unanswered, sends its
        commit itself."""
        segments, sessions = self.segments, self.sessions.sessions
        sid = segments.by_name.get(msg.segment)
        seg = segments.segs.get(sid) if sid is not None else None
        node = sessions.get(msg.node)
        client = sessions.get(msg.commit.client)
        conn = client.conns.get(msg.conn) if client is not None else None
        reply = None
        if (seg is not None and node is not None and msg.incarnation and 0 < msg.rid < 1 << 64
                and seg.client == msg.node and seg.incarnation == msg.incarnation
                and node.incarnation == msg.incarnation and sid in node.segs
                and conn is not None):
            reply = self.reserve.commit_landed(msg.commit, sid, msg.offset, msg.size)
        if reply is None:
            self.effects.counters["landings_ignored"] += 1
            return
        self.sessions.touch(msg.commit.client, None)
        self.effects.ready.append(((conn, msg.rid), reply))

    def task_done(self, msg: TaskDone) -> Message:
        self.tiers.task_done(msg)
        self.puts.retry(self.handlers)  # an offload may have made room for a waiting put
        return m.Ok()

    def tick(self) -> None:
        """Housekeeping, called every ``tick_s`` by the adapter."""
        self.fence.quarantine.release_due(self.clock.now(), self.segments.segs)
        self.membership.expire_sessions()
        self.leases.sweep()  # leases that expired unreleased
        self.puts.reclaim_zombies()
        self.eviction.watermark()
        self.eviction.keep_fit()
        self.puts.retry(self.handlers)
        self.eviction.drain()
        self.migrations.pump()

    def stats(self, msg: m.GetStats | None = None) -> m.Stats:
        n_resv = len(self.reservations)  # counted apart: reservations are not values
        out: dict[str, float] = {"objects": len(self.objects.objs) - n_resv,
                                 "pending": len(self.objects.pending) - n_resv,
                                 "reservations": n_resv, "leases": len(self.leases.open),
                                 "segments": len(self.segments.segs),
                                 "sessions": len(self.sessions.sessions),
                                 "tasks": len(self.tasks.tasks)}
        out.update(self.segments.usage())
        out.update(inline_objects=len(self.objects.inline),
                   inline_used=float(self.objects.inline_bytes),
                   inline_capacity=float(self.cfg.inline_capacity))
        out.update({k: float(v) for k, v in self.effects.counters.items()})
        out["quarantined_bytes"] = float(self.fence.quarantine.bytes(self.segments.segs))
        return m.Stats(values=out)
