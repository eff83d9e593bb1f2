"""The master process (`yuebing store master`): RPC adapter around `MasterCore`, plus HA roles.

A peer's frame ``[request id, msgpack message]`` (`wire`, `wire_server`) is decoded (a malformed
message gets ``Err(BAD_REQUEST)`` and changes nothing), applied to the core and answered with the
same id — at once, once every standby acknowledged its entries (sync replication), or when a
node reports a promotion's copy. Pushes (node tasks, replication entries) use id 0. Between
polls the loop runs the core's tick, publishes KV events (ZeroMQ PUB) and forwards entries.
Roles: the `Elector` decides; a standby answers ``NOT_LEADER`` and follows the leader, and when
elected takes over (`Replication.take_over`); a leader that loses its lease re-syncs as standby,
and its standbys' connections close: they subscribe again to whichever master leads next (this
one again when its lease was refreshed late but in time), none left following a dead stream.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import typing
import uuid

import zmq

from yuebing.core.clock import Clock
from yuebing.core.spin import window_s
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import (
    KvEvents,
    ReplAck,
    ReplEntries,
    ReplSnapshot,
    ReplSubscribe,
    TaskDone,
)
from yuebing.store.config import INLINE_BATCH_BYTES, MASTER_SPIN_REF_US, MasterConfig
from yuebing.store.master.core import MasterCore
from yuebing.store.master.election import Elector, EtcdElector, SingleElector
from yuebing.store.master.replication import ReplicationHub
from yuebing.store.wire import MAX_FRAME, FrameSocket
from yuebing.store.wire_limits import FrameLimits
from yuebing.store.wire_server import FrameServer

log = logging.getLogger(__name__)
C = m.Code


def bind(sock: zmq.Socket, address: str) -> str:
    """Bind ``address``; a tcp port 0 picks a free port. Returns the bound address."""
    if address.startswith("tcp://") and address.endswith(":0"):
        port = sock.bind_to_random_port(address[:-2])
        return f"{address[:-2]}:{port}"
    sock.bind(address)
    return address


RESUBSCRIBE_S = 0.2
"""A standby that could not subscribe (the leader unreachable, or it refused: not leading at
the moment) tries again after this."""
GC_THRESHOLDS = (50_000, 20, 1_000)
"""Young collections every 50k allocations (not 700): a burst of requests rarely triggers one."""
GC_FREEZE_S = 30.0


def limits_of(cfg: MasterConfig) -> FrameLimits:
    """The RPC port's limits (`wire_limits.FrameLimits`) from the master's config: frames up to
    ``max_request_bytes`` (8x that, and while it holds small values at least twice a client's
    batch of them, is still read and dropped with an error reply: the client then puts them
    the normal way; more closes the connection), ``rpc_buffer_bytes`` of incomplete frames,
    ``frame_timeout_s`` each."""
    discard = 8 * cfg.max_request_bytes
    if cfg.inline_max_bytes:
        discard = max(discard, 2 * INLINE_BATCH_BYTES)
    return FrameLimits(max_frame=cfg.max_request_bytes, budget=cfg.rpc_buffer_bytes,
                       frame_timeout_s=cfg.frame_timeout_s, discard_max=min(discard, MAX_FRAME))


def freeze_long_lived() -> None:
    """Collect the young generations and move every survivor to the permanent generation.

    The master's metadata (millions of `Obj` records, tuples, strings) is long-lived and
    acyclic; left in generation 2 it makes each full collection scan all of it (a stall of
    tens to hundreds of ms on a big master, seen as RPC p99 spikes). Frozen, it is never scanned;
    records dropped later are still freed by reference counting. Called at start and every
    ``GC_FREEZE_S`` by the serve loop.
    """
    gc.collect(1)
    gc.freeze()


class MasterService:
    """One master process (leader or standby). `serve` runs the loop in the calling thread."""

    def __init__(self, cfg: MasterConfig, clock: Clock | None = None,
                 elector: Elector | None = None) -> None:
        self.cfg = cfg
        self.core = MasterCore(cfg, clock)
        self.core.log = None
        self.server = FrameServer(cfg.rpc_address, self._on_frame,
                                  window_s(cfg.spin_us, MASTER_SPIN_REF_US), limits_of(cfg),
                                  self._refused, token=cfg.cluster_token,
                                  local=cfg.local_socket)
        self.address = self.server.address
        self.ctx: zmq.Context | None = None
        self.pub: zmq.Socket | None = None
        self.events_address = ""
        if cfg.events_address:
            self.ctx = zmq.Context()
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.events_address = bind(self.pub, cfg.events_address)
        self.elector = elector or (
            EtcdElector(cfg.etcd, cfg.cluster, self.address, cfg.election_ttl_s) if cfg.etcd
            else SingleElector(self.address))
        self.hub = ReplicationHub(self.core.replication, cfg.repl_timeout_s)
        self.name = f"master-{uuid.uuid4().hex[:8]}"
        self.lock = threading.Lock()
        self.leading = False
        self.event_seq = 0
        self._held: list[tuple[int, int, bytes]] = []
        self._follow: FrameSocket | None = None
        self._follow_addr = ""
        self._follow_seq = 0
        self._follow_after = 0.0
        self._stop = threading.Event()

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.elector.start()
        clock = self.core.clock
        next_tick = clock.now()
        log.warning("store master %s serving on %s", self.name, self.address)
        gc.set_threshold(*GC_THRESHOLDS)
        freeze_long_lived()
        next_freeze = time.monotonic() + GC_FREEZE_S
        try:
            while not self._stop.is_set():
                if time.monotonic() >= next_freeze:
                    with self.lock:
                        freeze_long_lived()
                    next_freeze = time.monotonic() + GC_FREEZE_S
                self._roles()
                self.server.poll(min(0.1, max(0.0, next_tick - clock.now())))
                if clock.now() >= next_tick:
                    if self.leading:
                        with self.lock:
                            self.core.tick()
                    next_tick = clock.now() + self.cfg.tick_s
                self._flush()
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        self.elector.close()
        self._unfollow()
        self.server.close()
        if self.pub is not None and self.ctx is not None:
            self.pub.close(0)
            self.ctx.term()

    # ------------------------------------------------------------------ requests
    def _on_frame(self, cid: int, rid: int, payload: bytes) -> None:
        core = self.core
        fx = core.effects
        with self.lock:
            before = len(fx.log) if fx.log is not None else 0
            try:
                msg = decode(payload)
            except ProtocolError as e:
                reply: Message | None = m.Err(code=C.BAD_REQUEST, message=str(e))
            else:
                probe = core.probes.get(type(msg))
                if probe is not None and self.leading:  # read-only, no session: answered at
                    try:  # once, never held
                        answer: Message = probe(msg)
                    except Exception as e:  # a bug must not take the master down
                        log.exception("probe %s failed", type(msg).__name__)
                        answer = m.Err(code=C.INTERNAL, message=f"{type(msg).__name__} failed: {e}")
                    self.server.send(cid, rid, encode(answer))
                    return
                direct = core.direct.get(type(msg))
                if direct is not None and self.leading:
                    try:
                        reply = direct(msg)
                    except Exception as e:  # a bug must not take the master down
                        log.exception("handler of %s failed", type(msg).__name__)
                        reply = m.Err(code=C.INTERNAL, message=f"{type(msg).__name__} failed: {e}")
                else:
                    reply = self._dispatch(msg, cid, rid)
            if reply is None:
                return
            out = encode(reply)
            if self.hub.standbys and fx.log is not None and len(fx.log) > before \
                    and self.cfg.sync_replication:  # standbys: `hub.must_hold`
                self._held.append((cid, rid, out))
            else:
                self.server.send(cid, rid, out)

    def _refused(self, cid: int, rid: int, why: str) -> None:
        """A request over ``max_request_bytes`` was dropped (`FrameServer`): tell its sender."""
        self.server.send(cid, rid, encode(m.Err(code=C.BAD_REQUEST, message=why)))

    def _dispatch(self, msg: Message, cid: int, rid: int) -> Message | None:
        t = type(msg)
        if t is ReplSubscribe or t is ReplAck:
            if not self.leading:
                return m.Err(code=C.NOT_LEADER, message="not the leader", leader=self._leader())
            if t is ReplAck:
                self.hub.ack(msg.standby, msg.seq)  # type: ignore[attr-defined]
                return None
            for ident, entries in self.hub.publish():  # entries already in the core go first
                self.server.send(ident, 0, encode(entries))
            return self.hub.subscribe(msg.standby, cid)  # type: ignore[attr-defined]
        if not self.leading:
            return m.Err(code=C.NOT_LEADER, message="this master is a standby",
                         leader=self._leader())
        try:
            return self.core.handle(msg, (cid, rid), cid)  # type: ignore[arg-type]
        except Exception as e:  # a bug must not take the master down
            log.exception("handler of %s failed", t.__name__)
            return m.Err(code=C.INTERNAL, message=f"{t.__name__} failed: {e}")

    def _leader(self) -> str:
        leader = self.elector.leader()
        return "" if leader == self.address else leader

    # ------------------------------------------------------------------ outputs
    def _flush(self) -> None:
        fx, hub = self.core.effects, self.hub
        if fx.outbox or fx.ready or self._held or hub.held or hub.standbys:
            self._flush_all()
        elif fx.events or fx.log:  # the usual case: events, entries that no standby takes
            with self.lock:
                if fx.events:
                    self._send_events()
                if self.leading:
                    hub.publish()
        # else nothing to do (only this thread adds to them)

    def _flush_all(self) -> None:
        core, send = self.core, self.server.send
        with self.lock:
            if core.events:
                self._send_events()
            for client, task in core.outbox:
                sess = core.sessions.sessions.get(client)
                if sess is not None and sess.ident is not None and sess.ident in self.server.conns:
                    send(sess.ident, 0, encode(task))  # type: ignore[arg-type]
                else:
                    core.tiers.task_done(TaskDone(  # not core.handle: no session touch
                        client=client, task=task.task, ok=False,
                        message=f"node {client} is not connected"))
            core.outbox.clear()
            if self.leading:
                for ident, msg in self.hub.publish():
                    send(ident, 0, encode(msg))
                for held in self._held:
                    self.hub.hold(held)
                self._held.clear()
            hold = self.leading and self.hub.must_hold and self.cfg.sync_replication
            for waiter, reply in core.ready:  # deferred replies (promotions, puts that waited
                conn, req = typing.cast(tuple[int, int], waiter)  # for room) wait for standbys
                if hold:                                          # like direct ones
                    self.hub.hold((conn, req, encode(reply)))
                else:
                    send(conn, req, encode(reply))
            core.ready.clear()
            for conn, req, out in self.hub.releasable():
                send(conn, req, out)

    def _send_events(self) -> None:
        fx = self.core.effects
        evs, fx.events = fx.events, []
        if self.pub is None:
            return
        self.event_seq += 1
        self.pub.send(encode(KvEvents(seq=self.event_seq, kinds=[int(e[0]) for e in evs],
                                        keys=[e[1] for e in evs], holders=[e[2] for e in evs])))

    # ------------------------------------------------------------------ roles
    def _roles(self) -> None:
        is_leader = self.elector.is_leader
        if is_leader and not self.leading:
            with self.lock:
                self._unfollow()
                self.core.replication.take_over()
                self.leading = True
        elif not is_leader and self.leading:
            log.error("lost leadership; stepping down to standby")
            with self.lock:
                self.leading = False
                self.core.log = None
                for sb in self.hub.standbys.values():  # they subscribe again to the next leader,
                    self.server.close_conn(sb.ident)  # this one too (a lease refreshed late)
                self.hub = ReplicationHub(self.core.replication, self.cfg.repl_timeout_s)
                for cid, rid, _ in self._held:
                    self.server.send(cid, rid, encode(m.Err(code=C.NOT_LEADER,
                                                            message="leader stepped down")))
                self._held.clear()
        if not self.leading:
            leader = self.elector.leader()
            if leader and leader != self.address and leader != self._follow_addr \
                    and time.monotonic() >= self._follow_after:
                self._subscribe(leader)

    def _subscribe(self, leader: str) -> None:
        self._unfollow()
        try:
            s = FrameSocket(leader, self.cfg.repl_timeout_s, token=self.cfg.cluster_token,
                            local=self.cfg.local_socket)
            s.send(1, encode(ReplSubscribe(standby=self.name)))
        except OSError as e:
            log.warning("cannot reach leader %s: %s", leader, e)
            self._follow_after = time.monotonic() + RESUBSCRIBE_S
            return
        self._follow, self._follow_addr = s, leader
        self.server.watch(s.sock, self._drain_follow)
        log.warning("standby %s following leader %s", self.name, leader)

    def _unfollow(self) -> None:
        if self._follow is not None:
            self.server.unwatch(self._follow.sock)
            self._follow.close()
        self._follow, self._follow_addr = None, ""

    def _drain_follow(self) -> None:
        assert self._follow is not None
        try:
            got = self._follow.recv(0.001)
        except OSError as e:
            log.warning("lost the leader %s: %s", self._follow_addr, e)
            self._unfollow()
            return
        while got is not None:
            self._apply_follow(decode(got[1]))
            if self._follow is None:
                return
            got = self._follow.recv(0.0) if self._follow.pending else None

    def _apply_follow(self, msg: Message) -> None:
        assert self._follow is not None
        with self.lock:
            if isinstance(msg, ReplSnapshot):
                self.core.replication.load_snapshot(msg.state)
                self._follow_seq = msg.seq
            elif isinstance(msg, ReplEntries):
                if msg.first_seq != self._follow_seq + 1:
                    log.error("replication gap (%d after %d); re-subscribing",
                              msg.first_seq, self._follow_seq)
                    self._subscribe(self._follow_addr)
                    return
                self.core.replication.apply_entries(msg.entries)
                self._follow_seq += len(msg.entries)
            else:  # `Err(NOT_LEADER)`: it stepped down since this master last read etcd
                log.warning("leader %s refused the subscription: %s", self._follow_addr, msg)
                self._unfollow()
                self._follow_after = time.monotonic() + RESUBSCRIBE_S
                return
        self._follow.send(2, encode(ReplAck(standby=self.name, seq=self._follow_seq)))
