"""Metadata replication from the leader master to its standbys (better than the original, whose
new leader starts empty).

The leader's core appends an entry to ``core.log`` for every change of durable metadata
(segments, puts, reservations and their renames at commit (which also feed each client's
record of recent commits, `reserve.Reservations.recent`), commits, deletions, replica
moves, pins, node tasks' destinations while they run); leases and recency are not
replicated (a new leader leases every value for ``lease_ttl_s``, see `take_over`). `ReplicationHub` (leader side) answers a `ReplSubscribe` with a `ReplSnapshot`, then
streams `ReplEntries`; each standby answers `ReplAck`. With ``sync_replication`` the service holds
the reply of every mutating call until all standbys acknowledged its entries, so a value whose
``put_end`` returned OK is on every standby. A standby silent for ``repl_timeout_s`` is dropped
(it re-subscribes and gets a fresh snapshot). `apply_entries` / `load_snapshot` (standby side)
rebuild the same metadata without allocators; `take_over` rebuilds allocators from the replicas
when a standby is elected, quarantining the destinations of the old leader's tasks in flight,
and starts task ids at 2**48 + a random 48-bit number: a late `TaskDone` for an old leader's
task is unlikely to carry a live id, and even then it ends nothing unless it comes from the
node that task was sent to (`segments.task_done` checks the client). Entries carry no
absolute times (clocks differ between hosts).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import msgspec

from yuebing.store.cluster_messages import ReplEntries, ReplSnapshot
from yuebing.store.master import fence, migration, reserve, segments
from yuebing.store.master.allocator import OffsetAllocator
from yuebing.store.master.core import MasterCore
from yuebing.store.master.state import Obj, ObjState, SegState

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ standby side
def _apply_put(core: MasterCore, e: list[Any]) -> None:
    _, key, size, checksum, reps, owner, pin, soft_s = e
    now = core.clock.now()
    core.objs[key] = Obj(size, checksum, tuple(tuple(r) for r in reps), owner, pin,
                         now + soft_s if soft_s else 0.0)
    core.pending[key] = core.expiry[key] = now + core.cfg.put_timeout_s  # conservative


def _apply_commit(core: MasterCore, e: list[Any]) -> None:
    o = core.objs[e[1]]
    o.state = ObjState.COMMITTED
    if o.owner is not None:  # kept, shared per client, as on the leader (`MasterCore._end_one`)
        o.owner = core.owner_id(o.owner)
    core.pending.pop(e[1], None)
    core.expiry.pop(e[1], None)


def _apply_del(core: MasterCore, e: list[Any]) -> None:
    o = core.objs.get(e[1])
    if o is not None:  # ["del", key, False]: a reservation given back unused, not fenced
        core._drop(e[1], o, event=False, fenced=len(e) < 3 or bool(e[2]))


def _apply_reps(core: MasterCore, e: list[Any]) -> None:
    core.objs[e[1]].reps = tuple(tuple(r) for r in e[2])


def _apply_pin(core: MasterCore, e: list[Any]) -> None:
    o = core.objs[e[1]]
    o.pin, o.soft = e[2], core.clock.now() + e[3] if e[3] else 0.0


def _apply_mount(core: MasterCore, e: list[Any]) -> None:
    _, sid, name, size, tier, node, client, *inc = e
    segments.add_segment(core, sid, name, size, tier, node, client, None, *inc)


def _apply_unmount(core: MasterCore, e: list[Any]) -> None:
    if e[1] in core.segs:
        segments.drop_segment(core, e[1])


def _apply_drain(core: MasterCore, e: list[Any]) -> None:
    core.segs[e[1]].state = SegState.DRAINING


_APPLY = {"put": _apply_put, "commit": _apply_commit, "del": _apply_del, "reps": _apply_reps,
          "pin": _apply_pin, "mount": _apply_mount, "unmount": _apply_unmount,
          "drain": _apply_drain, "resv": reserve.apply_resv, "rename": reserve.apply_rename,
          "task": fence.apply_task, "task_end": fence.apply_task_end}


def apply_entries(core: MasterCore, entries: list[list[Any]]) -> None:
    """Replay leader entries on a standby core (its ``log`` must be None)."""
    for e in entries:
        _APPLY[e[0]](core, e)
    core.events.clear()
    core.quarantine.release_due(core.clock.now(), core.segs)  # no allocators here: forgets them


def snapshot(core: MasterCore) -> bytes:
    """Every durable record of ``core`` as one msgpack blob (times made relative). An object's
    owner (pending: the writer; committed: the client whose retried commit answers OK) is an
    index into ``owners``, so a client's id is sent once, not once per value."""
    now = core.clock.now()
    segs = [[s.id, s.name, s.size, s.tier, s.node, s.client, int(s.state), s.incarnation]
            for s in core.segs.values()]
    owners: dict[str | None, int | None] = {None: None}  # each owner once, rows index it
    objs = [[k, o.size, o.checksum, o.reps, int(o.state),
             owners.setdefault(o.owner, len(owners) - 1), o.pin,
             max(0.0, o.soft - now) if o.soft else 0.0] for k, o in core.objs.items()]
    tasks = [[tid, t.dst[0], t.dst[1], t.size, max(0.0, t.expiry - now)]
             for tid, t in core.tasks.items()]
    return msgspec.msgpack.encode({"segs": segs, "objs": objs, "next_seg": core.next_seg,
                                   "quarantine": core.quarantine.dump(now), "tasks": tasks,
                                   "reservations": core.reservations.dump(),
                                   "recent_commits": core.reservations.dump_recent(),
                                   "owners": [c for c in owners if c is not None]})


def load_snapshot(core: MasterCore, blob: bytes) -> None:
    """Replace a standby core's metadata with a leader snapshot."""
    state = msgspec.msgpack.decode(blob)
    core.objs.clear()
    core.pending.clear()
    core.expiry.clear()
    core.segs.clear()
    core.seg_by_name.clear()
    core.sessions.clear()
    core.tasks.clear()
    core.drains = migration.Drains()  # a stale drain index would skip values now at risk
    core.reservations.clear()
    for sid, name, size, tier, node, client, st, *inc in state["segs"]:
        segments.add_segment(core, sid, name, size, tier, node, client, None,
                             *inc).state = SegState(st)
    owners = state.get("owners", [])
    for key, size, checksum, reps, st, owner, pin, soft_s in state["objs"]:
        if isinstance(owner, int):
            owner = owners[owner]
        _apply_put(core, ["put", key, size, checksum, reps, owner, pin, soft_s])
        if st == ObjState.COMMITTED:
            _apply_commit(core, ["commit", key])
    for row in state.get("reservations", []):
        reserve.apply_resv(core, ["resv", *row])
    core.reservations.load_recent(state.get("recent_commits", []))
    core.next_seg = max(core.next_seg, state["next_seg"])
    core.quarantine.load(core.clock.now(), state.get("quarantine", []))
    for tid, sid, off, size, left in state.get("tasks", []):
        fence.apply_task(core, ["task", tid, sid, off, size, left])


def take_over(core: MasterCore) -> None:
    """Make a standby core authoritative: allocators from replicas and quarantined ranges
    (`fence`: kept out of use until due), fresh session deadlines; pending puts get a fresh
    ``put_timeout_s`` and a write expiry as late (no absolute times cross hosts). Read leases
    are not replicated, so every value is treated as leased for ``lease_ttl_s``: a reader the
    old leader granted a lease is still copying, and nothing may evict or (unforced) remove
    the value under it; eviction resumes once those leases would have ended. The old leader's
    node tasks are forgotten, but their destinations stay quarantined until their write expiry
    (`fence.fence_inflight`), and task ids restart at 2**48 + a random 48-bit number (not
    necessarily above the old leader's: a late `TaskDone` is told apart by that randomness and
    by `segments.task_done` accepting only the node the task was sent to)."""
    used: dict[int, list[tuple[int, int]]] = {sid: [] for sid in core.segs}
    lease = core.clock.now() + core.cfg.lease_ttl_s
    for o in core.objs.values():
        o.moving = 0
        o.lease = max(o.lease, lease)
        for sid, off in o.reps:
            used[sid].append((off, o.size))
    fenced = fence.fence_inflight(core)
    align = core.cfg.alignment
    for sid, s in core.segs.items():
        held = core.quarantine.settle(sid, used[sid], align)
        s.alloc = OffsetAllocator.rebuild(s.size, align, used[sid] + held)
    now = core.clock.now()
    for sid, seg in core.segs.items():  # leases above may name their replicas: conservative
        if seg.state == SegState.DRAINING:
            core.drains.since[sid] = now
    for sess in core.sessions.values():
        sess.deadline = now + core.cfg.client_ttl_s
    for key in core.pending:
        core.pending[key] = core.expiry[key] = now + core.cfg.put_timeout_s
    core.tasks.clear()
    core.next_task = max(core.next_task, (1 << 48) + secrets.randbits(48))
    core.reservations.seq = max(core.reservations.seq, secrets.randbits(48))  # no name reuse
    core.log = []
    log.warning("took over as leader: %d objects, %d segments, %d destinations of tasks in "
                "flight quarantined", len(core.objs), len(core.segs), fenced)


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

    def __init__(self, core: MasterCore, timeout_s: float) -> None:
        self.core = core
        self.timeout_s = timeout_s
        self.seq = 0
        self.standbys: dict[str, _Standby] = {}
        self.held: list[tuple[int, Reply]] = []

    def subscribe(self, name: str, ident: int) -> ReplSnapshot:
        self.standbys[name] = _Standby(ident, self.seq, self.core.clock.now())
        log.warning("standby %s subscribed at seq %d", name, self.seq)
        return ReplSnapshot(seq=self.seq, state=snapshot(self.core))

    def publish(self) -> list[tuple[int, ReplEntries]]:
        """Take the core's new entries; returns the messages to send to standbys."""
        entries = self.core.log
        if not entries:
            return []
        self.core.log = []
        first = self.seq + 1
        now = self.core.clock.now()
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
            s.since = self.core.clock.now()

    def releasable(self) -> list[Reply]:
        """Replies whose entries every standby has (drops standbys that stopped acking)."""
        now = self.core.clock.now()
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
