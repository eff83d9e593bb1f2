"""Sessions of clients and nodes, and node processes by incarnation: `Sessions`.

Every request naming a client renews its session (`touch`, from `MasterCore.handle`); a session
whose deadline passes is dropped by `Membership` with its segments and pending puts. A node
process sends a fresh ``incarnation`` with `Mount`, `Heartbeat`, `Drain` and `Unmount`: a mount
from a restarted node (same name) retires the old process's segments (`on_mount` names them,
`Membership` drops them); heartbeats revive only their own process's SUSPECT segments; a retired
process is refused (EXISTS) and cannot unmount its successor's segment (`owns`).
"""

from __future__ import annotations

import logging

from yuebing.core.clock import Clock
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Drain, Mount, Unmount
from yuebing.store.config import MasterConfig
from yuebing.store.master.effects import Effects
from yuebing.store.master.segments import Segments
from yuebing.store.master.state import MAX_NAMED_CONNS, Seg, SegState, Session

log = logging.getLogger(__name__)
C = m.Code
MAX_RETIRED = 8
"""Retired incarnations remembered per session (the newest)."""


def _superseded(client: str, incarnation: str, sess: Session) -> m.Err:
    return m.Err(code=C.EXISTS, message=(
        f"node name {client!r} was taken over by a newer process (incarnation "
        f"{sess.incarnation or '?'}; this one, {incarnation}, is retired): stop this process "
        "or give it another --name"))


def owns(seg: Seg, msg: Unmount | Drain) -> bool:
    """Whether ``msg`` (same client) may act on ``seg``: without an incarnation always, else
    only the incarnation that mounted it (a retired process must not unmount its successor's
    segment of the same name)."""
    return not msg.incarnation or seg.incarnation == msg.incarnation


class Sessions:
    """``sessions``: client -> `Session` (deadline, transport identity, segments, incarnation
    and the retired ones)."""

    __slots__ = ("cfg", "clock", "effects", "segments", "sessions")

    def __init__(self, cfg: MasterConfig, clock: Clock, segments: Segments,
                 effects: Effects) -> None:
        self.cfg = cfg
        self.clock = clock
        self.segments = segments
        self.effects = effects
        self.sessions: dict[str, Session] = {}

    def touch(self, client: str, ident: bytes | None) -> Session:
        """Renew ``client``'s session (a new one if none); ``ident`` is its transport identity
        (kept so the master can push node tasks)."""
        s = self.sessions.get(client)
        deadline = self.clock.now() + self.cfg.client_ttl_s
        if s is None:
            s = self.sessions[client] = Session(deadline, ident)
        else:
            s.deadline = deadline
            if ident is not None:
                s.ident = ident
        return s

    def name_conn(self, client: str, conn: int, ident: bytes | None) -> None:
        """``client`` names its connection ``ident`` ``conn`` (`m.ConnName`); a session keeps
        the `MAX_NAMED_CONNS` named last."""
        if ident is None or not 0 < conn < 1 << 62:
            return
        conns = self.touch(client, ident).conns
        conns.pop(conn, None)
        conns[conn] = ident
        while len(conns) > MAX_NAMED_CONNS:
            del conns[next(iter(conns))]

    def add_segment(self, client: str, sid: int, incarnation: str) -> None:
        """``client`` mounted segment ``sid``; a segment mounted with an ``incarnation`` (also
        replayed on a standby) makes that process the current one."""
        sess = self.sessions.get(client)
        if sess is None:
            sess = self.touch(client, None)
        sess.segs.add(sid)
        if incarnation:
            sess.incarnation = incarnation

    def discard_segment(self, client: str, sid: int) -> None:
        sess = self.sessions.get(client)
        if sess is not None:
            sess.segs.discard(sid)

    def renew_all(self, now: float) -> None:
        """A new leader: every session gets a fresh ``client_ttl_s`` from ``now``."""
        for sess in self.sessions.values():
            sess.deadline = now + self.cfg.client_ttl_s

    def clear(self) -> None:
        self.sessions.clear()

    def forget(self, client: str) -> None:
        del self.sessions[client]

    def expired(self) -> list[tuple[str, Session]]:
        """The sessions whose deadline passed (`Membership.expire_sessions` drops them)."""
        now = self.clock.now()
        return [(c, s) for c, s in self.sessions.items() if s.deadline < now]

    def on_mount(self, msg: Mount) -> m.Err | list[Seg]:
        """Before ``msg`` mounts: refuse a retired incarnation; for a new one, return every
        segment of the session mounted by another incarnation (the caller retires them)."""
        inc = msg.incarnation
        if not inc:
            return []
        sess = self.touch(msg.client, None)
        if inc in sess.retired:
            return _superseded(msg.client, inc, sess)
        segs = self.segments.segs
        old = [segs[sid] for sid in sess.segs if segs[sid].incarnation != inc]
        if sess.incarnation != inc:
            if sess.incarnation:
                sess.retired = [*sess.retired[-(MAX_RETIRED - 1):], sess.incarnation]
            sess.incarnation = inc
        if old:
            log.warning("node %s restarted (incarnation %s): retiring the %d segments of its "
                        "previous process at once: %s", msg.client, inc, len(old),
                        ", ".join(s.name for s in old))
            self.effects.counters["dead_sessions"] += 1
        return old

    def heartbeat(self, msg: m.Heartbeat) -> m.Message:
        """A session's heartbeat (its deadline was renewed by `MasterCore.handle`): the
        segments of the heartbeating incarnation (all, without one) that a failed write marked
        SUSPECT take puts again; the reply names the session's segments of that incarnation,
        so a node whose segment the master dropped mounts it again."""
        sess = self.sessions[msg.client]
        inc = msg.incarnation
        if inc and inc in sess.retired:
            return _superseded(msg.client, inc, sess)
        segs = self.segments.segs
        mine: list[Seg] = [segs[sid] for sid in sess.segs]
        if inc:
            mine = [s for s in mine if s.incarnation == inc]
        for s in mine:  # the node is alive: its suspected segments take puts again
            if s.state == SegState.SUSPECT:
                s.state = SegState.ACTIVE
        return m.HeartbeatReply(segments=[s.name for s in mine])
