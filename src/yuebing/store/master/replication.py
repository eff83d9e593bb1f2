"""Metadata replication from the leader master to its standbys.

The leader's components append an entry to ``Effects.log`` for every change of durable
metadata (segments, puts, reservations and their renames, commits, deletions, replica moves,
pins, node tasks' destinations, and the values the master holds itself, with their commit);
leases and recency are not replicated. `ReplicationHub`
(leader side, driven by `MasterService`) answers a `ReplSubscribe` with a snapshot, streams the
entries and, with ``sync_replication``, holds replies until every standby acknowledged them.
`Replication` (standby side) replays entries and snapshots into the components, and
`take_over` makes them authoritative when this master is elected. Entries carry no absolute
times (clocks differ between hosts).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec

from yuebing.core.clock import Clock
from yuebing.protocol.store_cluster import ReplEntries, ReplSnapshot
from yuebing.store.config import MasterConfig
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.effects import Effects
from yuebing.store.master.fence import WriteFence
from yuebing.store.master.leases import Leases
from yuebing.store.master.membership import Membership
from yuebing.store.master.migration import Migrations
from yuebing.store.master.objects import Objects
from yuebing.store.master.reservations import Reservations
from yuebing.store.master.reserve import Reserve
from yuebing.store.master.segments import Segments
from yuebing.store.master.sessions import Sessions
from yuebing.store.master.state import ObjState, SegState
from yuebing.store.master.tasks import Tasks

log = logging.getLogger(__name__)


class Replication:
    """Snapshots, replay and takeover over the components that hold durable metadata; no
    state of its own."""

    def __init__(self, cfg: MasterConfig, clock: Clock, effects: Effects, segments: Segments,
                 sessions: Sessions, objects: Objects, fence: WriteFence, book: Reservations,
                 reserve: Reserve, tasks: Tasks, leases: Leases, migrations: Migrations,
                 membership: Membership) -> None:
        self.cfg = cfg
        self.clock = clock
        self.effects = effects
        self.segments = segments
        self.sessions = sessions
        self.objects = objects
        self.fence = fence
        self.book = book
        self.reserve = reserve
        self.tasks = tasks
        self.leases = leases
        self.migrations = migrations
        self.membership = membership
        self._apply = {"put": self._put, "commit": self._commit, "del": self._del,
                       "inline": self._inline,
                       "reps": self._reps, "pin": self._pin, "mount": self._mount,
                       "unmount": self._unmount, "drain": self._drain,
                       "resv": reserve.apply_resv, "rename": reserve.apply_rename,
                       "task": fence.apply_task, "task_end": fence.apply_task_end}

    # -------------------------------------------------------------- standby side
    def _put(self, e: list[Any]) -> None:
        _, key, size, checksum, reps, owner, pin, soft_s = e
        self.objects.restore(key, size, checksum, reps, owner, pin, soft_s)

    def _inline(self, e: list[Any]) -> None:
        _, key, size, checksum, value, owner, pin, soft_s = e
        self.objects.restore_inline(key, size, checksum, value, owner, pin, soft_s)

    def _commit(self, e: list[Any]) -> None:
        self.objects.restore_commit(e[1])

    def _del(self, e: list[Any]) -> None:
        o = self.objects.objs.get(e[1])
        if o is not None:  # ["del", key, False]: a reservation given back unused, not fenced
            self.objects.drop(e[1], o, event=False, fenced=len(e) < 3 or bool(e[2]))

    def _reps(self, e: list[Any]) -> None:
        self.objects.objs[e[1]].reps = tuple(tuple(r) for r in e[2])

    def _pin(self, e: list[Any]) -> None:
        o = self.objects.objs[e[1]]
        o.pin, o.soft = e[2], self.clock.now() + e[3] if e[3] else 0.0

    def _mount(self, e: list[Any]) -> None:
        _, sid, name, size, tier, node, client, *inc = e
        self.membership.add_segment(sid, name, size, tier, node, client, None, *inc)

    def _unmount(self, e: list[Any]) -> None:
        if e[1] in self.segments.segs:
            self.membership.drop_segment(e[1])

    def _drain(self, e: list[Any]) -> None:
        self.segments.segs[e[1]].state = SegState.DRAINING

    def apply_entries(self, entries: list[list[Any]]) -> None:
        """Replay leader entries on a standby (its ``Effects.log`` must be None)."""
        apply = self._apply
        for e in entries:
            apply[e[0]](e)
        self.effects.events.clear()
        q = self.fence.quarantine
        q.release_due(self.clock.now(), self.segments.segs)  # no allocators here: forgets them

    def snapshot(self) -> bytes:
        """Every durable record as one msgpack blob (times made relative). An object's owner
        (pending: the writer; committed: the client whose retried commit answers OK) is an
        index into ``owners``, so a client's id is sent once, not once per value. A value the
        master holds itself has its bytes as a ninth column."""
        now = self.clock.now()
        held = self.objects.inline
        segs = [[s.id, s.name, s.size, s.tier, s.node, s.client, int(s.state), s.incarnation]
                for s in self.segments.segs.values()]
        owners: dict[str | None, int | None] = {None: None}  # each owner once, rows index it
        objs = [[k, o.size, o.checksum, o.reps, int(o.state),
                 owners.setdefault(o.owner, len(owners) - 1), o.pin,
                 max(0.0, o.soft - now) if o.soft else 0.0, *((held[k],) if k in held else ())]
                for k, o in self.objects.objs.items()]
        tasks = [[tid, t.dst[0], t.dst[1], t.size, max(0.0, t.expiry - now)]
                 for tid, t in self.tasks.tasks.items()]
        return msgspec.msgpack.encode({"segs": segs, "objs": objs,
                                       "next_seg": self.segments.next_id,
                                       "quarantine": self.fence.quarantine.dump(now),
                                       "tasks": tasks, "reservations": self.book.dump(),
                                       "recent_commits": self.book.dump_recent(),
                                       "owners": [c for c in owners if c is not None]})

    def load_snapshot(self, blob: bytes) -> None:
        """Replace a standby's metadata with a leader snapshot."""
        state = msgspec.msgpack.decode(blob)
        self.objects.clear()
        self.segments.clear()
        self.sessions.clear()
        self.tasks.clear()
        self.migrations.reset()  # a stale drain index would skip values now at risk
        self.leases.forget_handouts()
        self.fence.inflight.clear()  # the snapshot's tasks, below, are the ones in flight
        self.book.clear()
        for sid, name, size, tier, node, client, st, *inc in state["segs"]:
            self.membership.add_segment(sid, name, size, tier, node, client, None,
                                        *inc).state = SegState(st)
        owners = state.get("owners", [])
        for key, size, checksum, reps, st, owner, pin, soft_s, *value in state["objs"]:
            if isinstance(owner, int):
                owner = owners[owner]
            if value:
                self.objects.restore_inline(key, size, checksum, value[0], owner, pin, soft_s)
                continue
            self.objects.restore(key, size, checksum, reps, owner, pin, soft_s)
            if st == ObjState.COMMITTED:
                self.objects.restore_commit(key)
        for row in state.get("reservations", []):
            self.reserve.apply_resv(["resv", *row])
        self.book.load_recent(state.get("recent_commits", []))
        self.segments.skip_ids(state["next_seg"])
        self.fence.quarantine.load(self.clock.now(), state.get("quarantine", []))
        for tid, sid, off, size, left in state.get("tasks", []):
            self.fence.apply_task(["task", tid, sid, off, size, left])

    def take_over(self) -> None:
        """Make a standby authoritative: allocators from replicas and quarantined ranges (kept
        out of use until due), fresh session deadlines; pending puts get a fresh
        ``put_timeout_s`` and a write expiry as late. Read leases are not replicated, so every
        value on a segment is treated as leased for ``lease_ttl_s`` (a reader of the old leader
        may still be copying; a held value's reader got the bytes in its reply). The old leader's node tasks are forgotten, their destinations quarantined
        until their write expiry (`WriteFence.fence_inflight`); task ids restart at 2**48 + a
        random 48-bit number (a late `TaskDone` is also checked against the node it was sent
        to), reservation numbers from a random base."""
        segs = self.segments.segs
        used: dict[int, list[tuple[int, int]]] = {sid: [] for sid in segs}
        lease = self.clock.now() + self.cfg.lease_ttl_s
        for o in self.objects.objs.values():
            o.moving = 0
            if o.reps:
                o.lease = max(o.lease, lease)
            for sid, off in o.reps:
                used[sid].append((off, o.size))
        fenced = self.fence.fence_inflight()
        align = self.cfg.alignment
        q = self.fence.quarantine
        for sid, s in segs.items():
            held = q.settle(sid, used[sid], align)
            s.alloc = OffsetAllocator.rebuild(s.size, align, used[sid] + held)
        now = self.clock.now()
        for sid, seg in segs.items():  # leases above may name their replicas: conservative
            if seg.state == SegState.DRAINING:
                self.migrations.begin(sid, now)
        self.sessions.renew_all(now)
        self.objects.restart_pending(now)
        self.tasks.restart((1 << 48) + secrets.randbits(48))
        self.book.renumber(secrets.randbits(48))  # no name reuse
        self.effects.log = []
        log.warning("took over as leader: %d objects, %d segments, %d destinations of tasks "
                    "in flight quarantined", len(self.objects.objs), len(segs), fenced)


# ------------------------------------------------------------------ leader side
Reply = tuple[int, int, bytes]
"""A reply waiting to be sent: (connection id, request id, encoded message)."""


class _Standby:
    __slots__ = ("acked", "ident", "since")

    def __init__(self, ident: int, acked: int, now: float) -> None:
        self.ident = ident
        self.acked = acked
        self.since = now


class ReplicationHub:
    """Leader side: standbys, sequence numbers and held replies."""

    def __init__(self, source: Replication, timeout_s: float) -> None:
        self.source = source
        self.timeout_s = timeout_s
        self.seq = 0
        self.standbys: dict[str, _Standby] = {}
        self.held: list[tuple[int, Reply]] = []

    def subscribe(self, name: str, ident: int) -> ReplSnapshot:
        self.standbys[name] = _Standby(ident, self.seq, self.source.clock.now())
        log.warning("standby %s subscribed at seq %d", name, self.seq)
        return ReplSnapshot(seq=self.seq, state=self.source.snapshot())

    def publish(self) -> list[tuple[int, ReplEntries]]:
        """Take the new entries; returns the messages to send to standbys."""
        effects = self.source.effects
        entries = effects.log
        if not entries:
            return []
        effects.log = []
        if not self.standbys:  # one that subscribes later starts from a snapshot
            self.seq += len(entries)
            return []
        first = self.seq + 1
        now = self.source.clock.now()
        for s in self.standbys.values():
            if s.acked == self.seq:
                s.since = now  # was idle and in sync: the ack clock starts now
        self.seq += len(entries)
        msg = ReplEntries(first_seq=first, entries=entries)
        return [(s.ident, msg) for s in self.standbys.values()]

    @property
    def must_hold(self) -> bool:
        return bool(self.standbys)

    def hold(self, reply: Reply) -> None:
        """Keep ``reply`` (connection id, request id, payload) until its entries are acked."""
        self.held.append((self.seq, reply))

    def ack(self, name: str, seq: int) -> None:
        s = self.standbys.get(name)
        if s is not None and seq > s.acked:
            s.acked = seq
            s.since = self.source.clock.now()

    def releasable(self) -> list[Reply]:
        """Replies whose entries every standby has (drops standbys that stopped acking)."""
        now = self.source.clock.now()
        for name, s in list(self.standbys.items()):
            if s.acked < self.seq and now - s.since > self.timeout_s:
                log.error("standby %s stopped acknowledging (at %d of %d); dropped from sync "
                          "replication", name, s.acked, self.seq)
                del self.standbys[name]
        if not self.held:
            return []
        floor = min((s.acked for s in self.standbys.values()), default=self.seq)
        out = [f for seq, f in self.held if seq <= floor]
        if out:
            self.held = [(seq, f) for seq, f in self.held if seq > floor]
        return out
