"""Node sessions by incarnation: a node process sends a fresh ``incarnation`` with its `Mount`,
`Heartbeat`, `Drain` and `Unmount`, so the master tells a restarted node (same ``--name``, so the
same session) from the process that held the name before.

Life of a restart: the old process is killed; within ``client_ttl_s`` a new one starts under the
same name and mounts. `on_mount` (from `segments.mount`) sees a new incarnation: it retires the
old incarnation's segments at once (`segments.drop_segment`: their values lose those replicas,
their capacity stops counting, no put is placed there) and records the old one as retired; the
new incarnation's heartbeats then keep only its own segments alive (`heartbeat`: a segment a
failed write marked SUSPECT takes puts again only when its own process heartbeats). A retired
incarnation that is still alive (two processes given one name) is refused (EXISTS) at its next
mount or heartbeat and stops. Messages without an incarnation (older nodes, clients) keep the
name-only behaviour.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from yuebing.store import messages as m
from yuebing.store.cluster_messages import Drain, Mount, Unmount
from yuebing.store.master.state import Seg, SegState, Session

if TYPE_CHECKING:
    from yuebing.store.master.core import MasterCore

log = logging.getLogger(__name__)
C = m.Code
MAX_RETIRED = 8
"""Retired incarnations remembered per session (the newest)."""


def _superseded(client: str, incarnation: str, sess: Session) -> m.Err:
    return m.Err(code=C.EXISTS, message=(
        f"node name {client!r} was taken over by a newer process (incarnation "
        f"{sess.incarnation or '?'}; this one, {incarnation}, is retired): stop this process "
        "or give it another --name"))


def on_mount(core: MasterCore, msg: Mount) -> m.Err | None:
    """Before ``msg`` mounts: refuse a retired incarnation; for a new one, retire every
    segment of the session mounted by another incarnation. Called by `segments.mount`."""
    inc = msg.incarnation
    if not inc:
        return None
    sess = core.touch_session(msg.client, None)
    if inc in sess.retired:
        return _superseded(msg.client, inc, sess)
    old = [core.segs[sid] for sid in sess.segs if core.segs[sid].incarnation != inc]
    if sess.incarnation != inc:
        if sess.incarnation:
            sess.retired = [*sess.retired[-(MAX_RETIRED - 1):], sess.incarnation]
        sess.incarnation = inc
    if old:
        from yuebing.store.master import segments

        log.warning("node %s restarted (incarnation %s): retiring the %d segments of its "
                    "previous process at once: %s", msg.client, inc, len(old),
                    ", ".join(s.name for s in old))
        core.counters["dead_sessions"] += 1
        for s in old:
            segments.drop_segment(core, s.id)
    return None


def heartbeat(core: MasterCore, msg: m.Heartbeat) -> m.Message:
    """A session's heartbeat (its deadline was renewed by `MasterCore.handle`): the segments
    of the heartbeating incarnation (all, without one) that a failed write marked SUSPECT take
    puts again; the reply names the session's segments of that incarnation, so a node whose
    segment the master dropped mounts it again."""
    sess = core.sessions[msg.client]
    inc = msg.incarnation
    if inc and inc in sess.retired:
        return _superseded(msg.client, inc, sess)
    mine: list[Seg] = [core.segs[sid] for sid in sess.segs]
    if inc:
        mine = [s for s in mine if s.incarnation == inc]
    for s in mine:  # the node is alive: its suspected segments take puts again
        if s.state == SegState.SUSPECT:
            s.state = SegState.ACTIVE
    return m.HeartbeatReply(segments=[s.name for s in mine])


def owns(seg: Seg, msg: Unmount | Drain) -> bool:
    """Whether ``msg`` (same client) may act on ``seg``: without an incarnation always, else
    only the incarnation that mounted it (a retired process must not unmount its successor's
    segment of the same name)."""
    return not msg.incarnation or seg.incarnation == msg.incarnation
