"""The master's side of the store's RPC framing (`wire`): `FrameServer`, an ``epoll`` loop
over non-blocking sockets, called from the master's serving thread only.

It bounds what peers make it hold (`wire_limits.FrameLimits`: ``--max-request-bytes``,
``--rpc-buffer-bytes``, ``--frame-timeout-s``; enforced by its `wire_limits.Intake`): bytes are
buffered only as they arrive, never reserved for a length a header announces, and a peer that
does not read its replies is not read from (`_watch_out`). Each cut is logged with the peer and
why; the others are still served. After a request it may poll briefly for the next (``spin_s``,
`Spinner`), only while requests lately came within the window (`GapPredictor`). Beside its TCP
socket it listens on the abstract Unix socket of that address (`wire.local_name`) for clients
on its own host; both kinds of connection are served alike.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from yuebing.core.spin import GapPredictor, Spinner
from yuebing.store.wire import (
    HEADER,
    RECV,
    FrameTooLarge,
    auth_preamble,
    local_name,
    parse_address,
    peer_cred,
)
from yuebing.store.wire_limits import Conn, FrameLimits, Intake, Refused

log = logging.getLogger(__name__)

LOCAL = "local"
"""What the local (Unix) listening socket serves in the poll table; the TCP one serves None."""
Handler = Callable[[int, int, bytes], None]
"""``on_frame(conn id, request id, payload)``: a complete frame to serve."""
IN, OUT = select.EPOLLIN, select.EPOLLOUT
HUP_ERR = select.EPOLLHUP | select.EPOLLERR
"""A hang-up or an error: it wakes the side a connection waits on, as `selectors` has it."""


class FrameServer:
    """Accepts connections and delivers frames to ``on_frame(conn id, rid, payload)``."""

    def __init__(self, address: str, on_frame: Handler, spin_s: float = 0.0,
                 limits: FrameLimits | None = None, on_refused: Refused | None = None,
                 token: str = "", local: bool = True) -> None:
        host, port = parse_address(address)
        self.lsock = socket.create_server((host, port), backlog=512)
        self.lsock.setblocking(False)
        self.address = f"tcp://{host}:{self.lsock.getsockname()[1]}"
        # epoll itself, not `selectors`: its wrapper costs ~1 us a poll, on every request
        self._ep = select.epoll()
        self._fds: dict[int, tuple[Any, int]] = {}  # fd -> (what it serves, its events)
        self._register(self.lsock, IN, None)
        self.usock = self._listen_local() if local else None
        """The abstract Unix socket of this TCP address (`wire.local_name`); None off Linux or
        when turned off."""
        self.conns: dict[int, Conn] = {}
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
        self.intake = Intake(self.limits, self.close_conn, on_refused,
                             auth_preamble(token) if token else b"")

    def _listen_local(self) -> socket.socket | None:
        """The abstract Unix socket of this TCP address; held by another socket, a start-up
        error as a taken port is (clients on loopback would go to that socket instead)."""
        if not sys.platform.startswith("linux"):
            return None
        host, port = self.lsock.getsockname()[:2]
        usock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            usock.bind(local_name(host, port))
            usock.listen(512)
        except OSError as e:
            usock.close()
            self._ep.close()
            self.lsock.close()
            raise OSError(e.errno, f"the local socket of {self.address} is held by another "
                          f"process ({e.strerror}); stop it, or start the master with "
                          "--no-local-socket") from e
        usock.setblocking(False)
        self._register(usock, IN, LOCAL)
        return usock

    @property
    def buffered(self) -> int:
        """Bytes of incomplete frames held across connections (bounded by ``limits.budget``)."""
        return self.intake.buffered

    @property
    def cut(self) -> int:
        """Connections closed for breaking a limit (oversized, too slow, over the budget) or
        for their cluster token."""
        return self.intake.cut

    @property
    def refused_auth(self) -> int:
        """Connections closed for a missing or wrong cluster token."""
        return self.intake.refused_auth

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        """Also poll ``sock`` (e.g. a follower connection) in this loop."""
        self._register(sock, IN, on_readable)

    def unwatch(self, sock: socket.socket) -> None:
        self._unregister(sock)

    def _register(self, sock: socket.socket, events: int, data: Any) -> None:
        fd = sock.fileno()
        if fd in self._fds:
            raise ValueError(f"socket {fd} is already polled")
        self._ep.register(fd, events)
        self._fds[fd] = (data, events)

    def _modify(self, sock: socket.socket, events: int, data: Any) -> None:
        fd = sock.fileno()
        self._ep.modify(fd, events)
        self._fds[fd] = (data, events)

    def _unregister(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if fd < 0:  # closed already (epoll forgot it then): find it by what it serves
            fd = next((f for f, (d, _) in self._fds.items()
                       if getattr(d, "sock", None) is sock), -1)
        if self._fds.pop(fd, None) is not None:
            with contextlib.suppress(OSError):  # closed meanwhile: the kernel dropped it
                self._ep.unregister(fd)

    def poll(self, timeout_s: float) -> None:
        """Serve what is ready, waiting up to ``timeout_s`` — polling without sleeping first while
        within ``spin_s`` of the last request served."""
        poll = self._ep.poll
        window = self._spin_until - time.perf_counter() if timeout_s > 0 else 0.0
        if window > 0 or timeout_s <= 0:
            ready = self._spinner.wait(lambda: poll(0), window)
            if not ready and timeout_s > 0:
                ready = poll(timeout_s)
        else:  # not spinning: one wait, not a poll and then the wait
            ready = poll(timeout_s)
        if ready and self.spin_s:  # spin for the next request only if requests come that fast
            self._spin_until = self._gaps.arrived(time.perf_counter())
        fds = self._fds
        for fd, ev in ready:
            got = fds.get(fd)
            if got is None:  # unregistered by a handler of this same poll
                continue
            data, want = got
            if data is None:
                self._accept(self.lsock)
            elif data is LOCAL:
                self._accept(self.usock)  # type: ignore[arg-type]
            elif callable(data):
                data()
            else:
                try:  # a hang-up or an error wakes both sides, as `selectors` has it
                    if ev & (IN | HUP_ERR) and want & IN:
                        self._read(data)
                    if ev & (OUT | HUP_ERR) and want & OUT and data.cid in self.conns:
                        self._write(data)
                except Exception:  # a bug must cost one connection, never the serving loop
                    log.exception("connection %d from %s: closing it after an internal error",
                                  data.cid, data.peer)
                    self.close_conn(data.cid)
        self.intake.sweep()  # frames whose sender went quiet mid-way

    def _accept(self, lsock: socket.socket) -> None:
        while True:
            try:
                sock, peer = lsock.accept()
            except BlockingIOError:
                return
            sock.setblocking(False)
            if lsock is self.lsock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                name = f"{peer[0]}:{peer[1]}"
            else:  # a Unix peer has no address: name it by its process
                name = f"local pid {peer_cred(sock)[0]}"  # (its token is checked as over TCP)
            c = Conn(sock, next(self._ids), name, self.limits.max_frame)
            self.conns[c.cid] = c
            self._register(sock, IN, c)
            self.intake.admit(c)

    def _read(self, c: Conn) -> None:
        try:
            n = c.sock.recv_into(self._rbuf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        if not n:
            self.close_conn(c.cid)
            return
        if n >= 12 and c.auth is None and not (c.skip or c.inb.buf or c.backlog):
            length, rid = HEADER.unpack_from(self._rbuf)  # the usual request: one whole
            if n == 12 + length and length <= self.limits.max_frame:  # frame, nothing before
                self.on_frame(c.cid, rid, bytes(self._rview[12:n]))  # (no partial frame to
                return  # count or time)
        data = self._rview[:n]
        if c.auth is not None:
            data = self.intake.authenticate(c, data)
            if not data:
                return
        if c.skip:  # the payload of a refused frame: dropped as it arrives
            data = self.intake.skip(c, data)
        if data:
            c.inb.buf += data
            if not self._parse(c):
                return
        self.intake.track(c)

    def _parse(self, c: Conn) -> bool:
        """Deliver the complete frames of ``c``'s buffer, refusing oversized ones (`Intake`),
        then count what stays buffered against the budget; False if ``c`` was closed
        meanwhile."""
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
            if not self.intake.refuse(c, oversize):
                self.close_conn(cid)
                return False
        return self.intake.count(c)

    def _deliver(self, c: Conn, frames: list[tuple[int, bytes]]) -> None:
        """Serve ``frames`` of ``c`` in order; once its unsent replies pause it (`_watch_out`),
        the rest wait in its backlog (at most one read's worth: nothing more is read)."""
        for i, (rid, payload) in enumerate(frames):
            if c.paused or c.cid not in self.conns:
                c.backlog.extend(frames[i:])
                return
            self.on_frame(c.cid, rid, payload)

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

    def _watch_out(self, c: Conn) -> None:
        """Wait for ``c`` to take its unsent replies; while they exceed ``max_frame`` its
        requests are not read (a peer that does not read its replies cannot pile them up)."""
        paused = len(c.out) > self.limits.max_frame or (c.paused and
                                                         len(c.out) > self.limits.max_frame // 2)
        if paused != c.paused:
            c.paused = paused
            if paused:
                log.info("connection %d from %s: %d reply bytes unread; not reading its "
                         "requests until it takes them", c.cid, c.peer, len(c.out))
        self._modify(c.sock, (0 if paused else IN) | (OUT if c.out else 0), c)
        if not paused and c.backlog:  # taken enough: serve what waited
            backlog, c.backlog = c.backlog, []
            self._deliver(c, backlog)

    def _write(self, c: Conn) -> None:
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
            self.intake.forget(c)
            self._unregister(c.sock)
            c.sock.close()

    def close(self) -> None:
        for cid in list(self.conns):
            self.close_conn(cid)
        self._ep.close()
        self.lsock.close()
        if self.usock is not None:
            self.usock.close()
