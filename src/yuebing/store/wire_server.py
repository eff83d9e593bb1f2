"""The master's side of the store's RPC framing (`wire`): `FrameServer`, a ``selectors`` loop
over non-blocking sockets, called from the master's serving thread only.

It bounds what peers make it hold (`FrameLimits`, the master's ``--max-request-bytes``,
``--rpc-buffer-bytes``, ``--frame-timeout-s``): bytes are only ever buffered as they arrive,
never reserved for a length a header announces. A frame announced longer than ``max_frame`` is
refused — its payload read and dropped (nothing kept) and `on_refused` told, so the sender gets a
precise error on a connection that stays usable — or, announced longer than ``discard_max``, the
connection is closed at once. A frame whose bytes are still arriving ``frame_timeout_s`` after
its first byte closes its connection (a peer trickling bytes holds no buffer or slot for long).
When the incomplete frames of all connections together hold more than ``budget`` bytes, the
connection holding the most is closed. A peer that sends requests without reading the replies
is not read from while its unsent replies exceed ``max_frame``. Each cut is logged with the
peer's address and why; the server keeps serving the others.

With a cluster token (``token``), a new connection must first send `wire.auth_preamble`,
checked (`wire.TokenCheck`) before any frame is parsed; anything else — a frame header from a
client without the token, a wrong token, no preamble within ``frame_timeout_s`` — closes the
connection, logged with the peer.

After serving a request it polls briefly for the next (``spin_s``, `Spinner`) — only while
requests have lately been arriving within the window (`GapPredictor`: a steady trickle of
requests further apart, such as heartbeats, costs no spinning), at most ``spin_s`` of CPU per
request, and not while the CPU is contended.
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.core.spin import GapPredictor, Spinner
from yuebing.store.wire import (
    HEADER,
    MAX_FRAME,
    RECV,
    FrameBuffer,
    FrameTooLarge,
    TokenCheck,
    auth_preamble,
    parse_address,
)

log = logging.getLogger(__name__)

SWEEP_S = 0.25
"""How often `FrameServer.poll` looks for incomplete frames past their deadline."""


@dataclass(frozen=True)
class FrameLimits:
    """What one `FrameServer` port accepts: ``max_frame`` bytes per frame (longer ones are
    refused, up to ``discard_max`` read and dropped, beyond it the connection is closed),
    ``budget`` bytes of incomplete frames across all its connections, and ``frame_timeout_s``
    for a frame's bytes to arrive once its first byte has (0 = no deadline)."""

    max_frame: int = MAX_FRAME
    budget: int = 4 * MAX_FRAME
    frame_timeout_s: float = 0.0
    discard_max: int = MAX_FRAME

    def __post_init__(self) -> None:
        if not 12 < self.max_frame <= min(self.discard_max, MAX_FRAME):
            raise ValueError(f"max_frame must be in 13..min(discard_max, {MAX_FRAME}), "
                             f"got {self.max_frame}")
        if self.budget < self.max_frame:
            raise ValueError(f"budget ({self.budget}) must hold one frame of max_frame "
                             f"({self.max_frame}) bytes")
        if not 0 <= self.frame_timeout_s < 1e9:
            raise ValueError(f"frame_timeout_s must be >= 0 seconds, got {self.frame_timeout_s}")


class _Conn:
    """One accepted connection: its incomplete input, unsent output, and the state of a frame
    being received (``started``: monotonic time of its first byte, 0 = none) or refused
    (``skip``: payload bytes still to drop, ``refused``: its request id and why)."""

    __slots__ = ("auth", "backlog", "cid", "counted", "inb", "out", "paused", "peer", "refused",
                 "skip", "sock", "started")

    def __init__(self, sock: socket.socket, cid: int, peer: str, max_frame: int) -> None:
        self.sock = sock
        self.cid = cid
        self.peer = peer
        self.inb = FrameBuffer(max_frame)
        self.out = bytearray()
        self.started = 0.0
        self.skip = 0
        self.refused: tuple[int, str] | None = None
        self.paused = False
        self.counted = 0  # bytes of ``inb`` counted in the server's ``buffered``
        self.backlog: list[tuple[int, bytes]] = []  # frames read, not served while paused
        self.auth: TokenCheck | None = None  # until the token preamble has been checked


Handler = Callable[[int, int, bytes], None]
Refused = Callable[[int, int, str], None]
"""``on_refused(conn id, request id, why)``: a frame was refused (too long) and dropped."""


class FrameServer:
    """Accepts connections and delivers frames to ``on_frame(conn id, rid, payload)``."""

    def __init__(self, address: str, on_frame: Handler, spin_s: float = 0.0,
                 limits: FrameLimits | None = None, on_refused: Refused | None = None,
                 token: str = "") -> None:
        host, port = parse_address(address)
        self._preamble = auth_preamble(token) if token else b""
        self.lsock = socket.create_server((host, port), backlog=512)
        self.lsock.setblocking(False)
        self.address = f"tcp://{host}:{self.lsock.getsockname()[1]}"
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.lsock, selectors.EVENT_READ, None)
        self.conns: dict[int, _Conn] = {}
        self.on_frame = on_frame
        self._ids = itertools.count(1)
        # recv_into one reused buffer: recv(n) allocates n bytes per call (~25 us at 1 MiB)
        self._rbuf = bytearray(RECV)
        self._rview = memoryview(self._rbuf)
        self.spin_s = spin_s
        self._spin_until = 0.0
        self._spinner = Spinner()
        self._gaps = GapPredictor(spin_s)
        self.limits = limits or FrameLimits()
        self.on_refused = on_refused
        self.buffered = 0
        """Bytes of incomplete frames held across connections (bounded by ``limits.budget``)."""
        self._partial: dict[int, _Conn] = {}  # connections with a frame under way
        self._next_sweep = 0.0
        self.cut = 0
        """Connections closed for breaking a limit (oversized, too slow, over the budget) or
        for their cluster token."""
        self.refused_auth = 0
        """Connections closed for a missing or wrong cluster token."""

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        """Also poll ``sock`` (e.g. a follower connection) in this loop."""
        self.sel.register(sock, selectors.EVENT_READ, on_readable)

    def unwatch(self, sock: socket.socket) -> None:
        self.sel.unregister(sock)

    def poll(self, timeout_s: float) -> None:
        """Serve what is ready, waiting up to ``timeout_s`` — polling without sleeping first while
        within ``spin_s`` of the last request served."""
        select = self.sel.select
        window = self._spin_until - time.perf_counter() if timeout_s > 0 else 0.0
        ready = self._spinner.wait(lambda: select(0), window)
        if not ready and timeout_s > 0:
            ready = select(timeout_s)
        if ready and self.spin_s:  # spin for the next request only if requests come that fast
            self._spin_until = self._gaps.arrived(time.perf_counter())
        for key, events in ready:
            data = key.data
            if data is None:
                self._accept()
            elif callable(data):
                data()
            else:
                try:
                    if events & selectors.EVENT_READ:
                        self._read(data)
                    if events & selectors.EVENT_WRITE and data.cid in self.conns:
                        self._write(data)
                except Exception:  # a bug must cost one connection, never the serving loop
                    log.exception("connection %d from %s: closing it after an internal error",
                                  data.cid, data.peer)
                    self.close_conn(data.cid)
        if self._partial and self.limits.frame_timeout_s:
            now = time.monotonic()
            if now >= self._next_sweep:  # frames whose sender went quiet mid-way
                self._next_sweep = now + SWEEP_S
                for c in list(self._partial.values()):
                    self._check_deadline(c, now)

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.lsock.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = _Conn(sock, next(self._ids), f"{peer[0]}:{peer[1]}", self.limits.max_frame)
            self.conns[c.cid] = c
            self.sel.register(sock, selectors.EVENT_READ, c)
            if self._preamble:  # nothing is parsed before the token; its wait has a deadline
                c.auth = TokenCheck(self._preamble)
                c.started = time.monotonic()
                self._partial[c.cid] = c

    def _read(self, c: _Conn) -> None:
        try:
            n = c.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self.close_conn(c.cid)
            return
        data = self._rview[:n]
        if c.auth is not None:
            data = self._authenticate(c, data)
            if not data:
                return
        if c.skip:  # the payload of a refused frame: dropped as it arrives
            k = min(n, c.skip)
            c.skip -= k
            data = data[k:]
            if not c.skip:
                self._answer_refused(c)
        if data:
            c.inb.buf += data
            if not self._parse(c):
                return
        self._track(c)

    def _authenticate(self, c: _Conn, data: memoryview) -> memoryview:
        """Feed ``data`` to ``c``'s token check; the bytes after the preamble (empty while it
        is incomplete or when ``c`` was closed for a wrong one)."""
        assert c.auth is not None
        k, why = c.auth.feed(data)
        if why:
            self._refuse_auth(c, why)
        if why or not c.auth.done:
            return data[:0]
        c.auth = None
        c.started = 0.0
        self._partial.pop(c.cid, None)
        return data[k:]

    def _refuse_auth(self, c: _Conn, why: str) -> None:
        self.cut += 1
        self.refused_auth += 1
        self._drop(c, f"refused: {why}")

    def _parse(self, c: _Conn) -> bool:
        """Deliver the complete frames of ``c``'s buffer, refusing oversized ones, then count
        what stays buffered against the budget; False if ``c`` was closed meanwhile."""
        cid = c.cid
        while True:
            try:
                frames, oversize = c.inb.frames(), None
            except FrameTooLarge as e:
                frames, oversize = e.frames, e
            if frames or oversize is not None:
                c.started = 0.0  # a frame ended: the deadline counts from the next one's start
            self._deliver(c, frames)
            if cid not in self.conns:  # closed by a handler
                return False
            if oversize is None:
                break
            if not self._refuse(c, oversize):
                self.close_conn(cid)
                return False
        self.buffered += len(c.inb.buf) - c.counted
        c.counted = len(c.inb.buf)
        return self._within_budget(c)

    def _deliver(self, c: _Conn, frames: list[tuple[int, bytes]]) -> None:
        """Serve ``frames`` of ``c`` in order; once its unsent replies pause it (`_watch_out`),
        the rest wait in its backlog (at most one read's worth: nothing more is read)."""
        for i, (rid, payload) in enumerate(frames):
            if c.paused or c.cid not in self.conns:
                c.backlog.extend(frames[i:])
                return
            self.on_frame(c.cid, rid, payload)

    def _refuse(self, c: _Conn, e: FrameTooLarge) -> bool:
        """``c``'s buffer starts with the header of a frame over ``max_frame``: drop it and
        its payload (as much as is buffered now, the rest as it arrives) and answer the sender
        once it is all read; False when it is even over ``discard_max`` (close ``c``)."""
        lim = self.limits
        why = (f"request of {e.length} bytes exceeds this port's limit of {lim.max_frame} "
               "bytes (the master's --max-request-bytes): split it")
        if e.length > lim.discard_max:
            log.warning("closing connection %d from %s: a frame of %d bytes was announced "
                        "(limit %d; more than %d is not even read)", c.cid, c.peer, e.length,
                        lim.max_frame, lim.discard_max)
            self.cut += 1
            return False
        log.warning("connection %d from %s: refusing a frame of %d bytes (limit %d); its "
                    "payload is dropped as it arrives", c.cid, c.peer, e.length, lim.max_frame)
        buf = c.inb.buf
        have = min(len(buf) - 12, e.length)
        del buf[:12 + have]
        c.refused = (e.rid, why)
        c.skip = e.length - have
        if not c.skip:
            self._answer_refused(c)
        return True

    def _answer_refused(self, c: _Conn) -> None:
        if c.refused is not None and self.on_refused is not None:
            self.on_refused(c.cid, *c.refused)
        c.refused = None

    def _track(self, c: _Conn) -> None:
        """Note when ``c``'s current incomplete frame began (its deadline counts from then; a
        frame ending restarts it, so a client streaming requests back to back is never cut)."""
        if c.inb.buf or c.skip:
            if not c.started:
                c.started = time.monotonic()
                self._partial[c.cid] = c
            else:
                self._check_deadline(c, time.monotonic())
        else:
            c.started = 0.0
            self._partial.pop(c.cid, None)

    def _check_deadline(self, c: _Conn, now: float) -> None:
        limit = self.limits.frame_timeout_s
        if limit and c.started and now - c.started > limit and c.auth is not None:
            self._refuse_auth(c, f"no cluster token within {limit}s of connecting")
        elif limit and c.started and now - c.started > limit:
            self.cut += 1
            self._drop(c, f"a frame still incomplete {now - c.started:.1f}s after its first "
                          f"byte (limit {limit}s; {len(c.inb.buf) + c.skip} bytes held or "
                          "pending)")

    def _within_budget(self, c: _Conn) -> bool:
        """Over ``budget`` bytes of incomplete frames in all: close the connection holding the
        most (a peer ballooning the server); False if that was ``c``."""
        budget = self.limits.budget
        while self.buffered > budget:
            big = max(self._partial.values(), key=lambda x: len(x.inb.buf), default=c)
            if len(c.inb.buf) > len(big.inb.buf):
                big = c
            self.cut += 1
            self._drop(big, f"{len(big.inb.buf)} bytes of an incomplete frame, with "
                            f"{self.buffered} held by all connections (budget {budget})")
            if big is c:
                return False
        return True

    def _drop(self, c: _Conn, why: str) -> None:
        if why:
            log.warning("closing connection %d from %s: %s", c.cid, c.peer, why)
        self.close_conn(c.cid)

    def send(self, cid: int, rid: int, payload: bytes) -> None:
        c = self.conns.get(cid)
        if c is None:
            return
        data = HEADER.pack(len(payload), rid) + payload
        if c.out:
            c.out += data
            if not c.paused and len(c.out) > self.limits.max_frame:
                self._watch_out(c)
            return
        try:
            n = c.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self.close_conn(cid)
            return
        if n < len(data):
            c.out += data[n:]
            self._watch_out(c)

    def _watch_out(self, c: _Conn) -> None:
        """Wait for ``c`` to take its unsent replies; while they exceed ``max_frame`` its
        requests are not read (a peer that does not read its replies cannot pile them up)."""
        paused = len(c.out) > self.limits.max_frame or (c.paused and
                                                         len(c.out) > self.limits.max_frame // 2)
        if paused != c.paused:
            c.paused = paused
            if paused:
                log.info("connection %d from %s: %d reply bytes unread; not reading its "
                         "requests until it takes them", c.cid, c.peer, len(c.out))
        events = (0 if paused else selectors.EVENT_READ) | (selectors.EVENT_WRITE if c.out else 0)
        self.sel.modify(c.sock, events, c)
        if not paused and c.backlog:  # taken enough: serve what waited
            backlog, c.backlog = c.backlog, []
            self._deliver(c, backlog)

    def _write(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close_conn(c.cid)
            return
        del c.out[:n]
        if c.paused or not c.out:
            self._watch_out(c)

    def close_conn(self, cid: int) -> None:
        c = self.conns.pop(cid, None)
        if c is not None:
            self.buffered -= c.counted
            self._partial.pop(cid, None)
            self.sel.unregister(c.sock)
            c.sock.close()

    def close(self) -> None:
        for cid in list(self.conns):
            self.close_conn(cid)
        self.sel.close()
        self.lsock.close()
