"""Frame I/O on a lane socket: ``[u32 header length][msgpack header][payload bytes]``.

Used by both ends of a TCP lane (`tcp_client`, `tcp_inline`, `tcp_server`) from their own
threads. Payloads are not copied by Python: writes go out with ``sendmsg`` straight from the
caller's buffer (several frames per call, `send_parts`) and reads land with ``recv_into``
straight in registered memory. `FrameReader` reads headers with one ``recv`` of up to `PEEK`
bytes, so a run of small frames costs fewer system calls; no buffer is sized by what a header
announces before its bytes arrive. A reader with ``spin_s`` receives a short payload with
non-blocking ``readv`` calls while bytes keep arriving (`spin_scatter`) instead of sleeping; a
long one sleeps a few times, once per part of it (``SO_RCVLOWAT``, `_Lowat`).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import time
from typing import Any

from yuebing.protocol import Message, decode, encode

_LEN = struct.Struct("<I")
MAX_HEADER = 4 << 20
_DRAIN_CHUNK = 1 << 20
PEEK = 16 << 10
IOV_MAX = 512
"""Most buffers handed to one ``sendmsg`` / ``recvmsg_into`` (Linux allows 1024)."""
LOWAT_MIN = 4 * PEEK
"""A payload run longer than this (a `FrameReader`'s buffer) is received in one wake-up
(`_Lowat`) rather than spun for (`spin_scatter` only takes what has already arrived)."""
LOWAT_PARTS = 4
"""A long payload run is received in about this many wake-ups (`_Lowat`): each part is copied
out while the sender still sends the next, so only the last part's copy follows the sender's."""
SPIN_CAP_S = 0.05
"""Longest one `spin_scatter` call polls before handing over to the blocking receive."""


class IdleTimeout(TimeoutError):
    """The socket timed out before the first byte of a frame: the lane is idle, not broken."""


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def tune_socket(sock: socket.socket, buffer_bytes: int, timeout_s: float | None) -> None:
    """TCP_NODELAY, large kernel buffers, and an I/O timeout."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:  # 0 keeps the kernel's auto-tuning
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)
    sock.settimeout(timeout_s)


def pack(msg: Message) -> bytes:
    header = encode(msg)
    return _LEN.pack(len(header)) + header


def send_frame(sock: socket.socket, msg: Message, payload: memoryview | None = None) -> None:
    """Send one frame; with ``payload`` the header and payload leave in one ``sendmsg``."""
    head = pack(msg)
    if payload is None:
        sock.sendall(head)
        return
    total = len(head) + payload.nbytes
    sent = sock.sendmsg([head, payload])
    if sent < total:
        if sent < len(head):
            sock.sendall(head[sent:])
            sent = len(head)
        sock.sendall(payload[sent - len(head):])


def recv_exact(sock: socket.socket, view: memoryview, idle_ok: bool = False) -> None:
    """Fill ``view`` completely from ``sock``; `PeerClosed` on EOF. With ``idle_ok``, a timeout
    before any byte arrived raises `IdleTimeout` (safe to retry) instead of `TimeoutError`."""
    got, n = 0, view.nbytes
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        except TimeoutError:
            if idle_ok and got == 0:
                raise IdleTimeout("idle") from None
            raise
        if k == 0:
            raise PeerClosed("peer closed the connection")
        got += k


def recv_scatter(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill every view completely, in order, with as few ``recvmsg_into`` calls as the kernel
    allows (up to `IOV_MAX` views each); `PeerClosed` on EOF. A run longer than `LOWAT_MIN`
    is received with ``SO_RCVLOWAT`` set to what is still missing (`_Lowat`)."""
    left = sum(v.nbytes for v in views)
    with _Lowat(sock, left) as lowat:
        i, n = 0, len(views)
        while i < n:
            k = sock.recvmsg_into(views[i:i + IOV_MAX], socket.MSG_WAITALL)[0]
            if k == 0:
                raise PeerClosed("peer closed the connection")
            left -= k
            while i < n and k >= views[i].nbytes:
                k -= views[i].nbytes
                i += 1
            if k:
                views = [views[i][k:], *views[i + 1:]]
                i, n = 0, len(views)
            if i < n:
                lowat.set(left)


class _Lowat:
    """``SO_RCVLOWAT`` of a socket at a part of the run a receive waits for, back to 1 on exit.
    The kernel then wakes the receiver (and answers its ``poll``) once that much is there
    instead of at every arriving segment: about `LOWAT_PARTS` sleeps and ``recvmsg`` calls per
    run instead of a wake-up, ``poll`` and ``recvmsg`` per segment, and the sender stops paying
    for the receiver's wake-ups; yet each part is copied out while the next still arrives (a
    mark at the whole run made the receiver's copy wait for the sender's). Never above what the
    peer still owes (a mark above it would wait forever), and at most a quarter of the receive
    buffer: kernels before 5.11 do not wake a receiver whose window fills below its mark.
    Only for runs over `LOWAT_MIN`."""

    __slots__ = ("sock", "mark", "cap")

    def __init__(self, sock: socket.socket, nbytes: int) -> None:
        raw = getattr(sock, "sock", sock)  # a `DeadlineSocket` wraps the socket
        self.sock = raw if nbytes > LOWAT_MIN and isinstance(raw, socket.socket) else None
        self.mark = 1
        self.cap = 1
        if self.sock is not None:
            self.cap = min(max(LOWAT_MIN, nbytes // LOWAT_PARTS),
                           self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
        self.set(nbytes)

    def set(self, nbytes: int) -> None:
        if self.sock is not None and nbytes != self.mark:
            mark = max(1, min(nbytes, self.cap) if nbytes > LOWAT_MIN else 1)
            if mark != self.mark:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
                self.mark = mark

    def __enter__(self) -> _Lowat:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mark != 1 and self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self.mark = 1


def _advance(views: list[memoryview], k: int) -> list[memoryview]:
    """``views`` less their first ``k`` bytes."""
    i = 0
    while i < len(views) and k >= views[i].nbytes:
        k -= views[i].nbytes
        i += 1
    if k:
        return [views[i][k:], *views[i + 1:]]
    return views[i:]


def spin_scatter(sock: socket.socket, views: list[memoryview], spin_s: float) -> list[memoryview]:
    """Fill ``views`` with non-blocking ``readv`` calls while bytes keep arriving; returns what
    is still unfilled once ``spin_s`` passes without progress, or `SPIN_CAP_S` in all, or the
    socket's ``end`` (monotonic deadline: `DeadlineSocket`, the server's fenced payloads) has
    passed — the caller finishes with its blocking receive, which enforces that deadline.
    Needs a socket in timeout mode (its descriptor is non-blocking); `PeerClosed` on EOF.
    Polling pays because on loopback the sender pays for every wake-up of a sleeping receiver
    (benchmarks/tcp_receive_spin.py)."""
    if getattr(sock, "sock", sock).gettimeout() is None:  # a blocking descriptor (no timeout
        return views  # mode; known without a system call): readv would block past any timeout
    fd = sock.fileno()
    now = time.monotonic()
    stop = min(now + SPIN_CAP_S, getattr(sock, "end", 0.0) or now + SPIN_CAP_S)
    if now >= stop:
        return views
    idle_until = now + spin_s
    while views:
        try:
            k = os.readv(fd, views[:IOV_MAX])
        except (BlockingIOError, InterruptedError):
            now = time.monotonic()
            if now > idle_until or now > stop:
                return views
            continue
        if k == 0:
            raise PeerClosed("peer closed the connection")
        views = _advance(views, k)
        now = time.monotonic()
        if now > stop:  # a trickling peer must not hold us past the caller's deadline
            return views
        idle_until = now + spin_s
    return views


def recv_frame(sock: socket.socket, idle_ok: bool = False) -> Message:
    """Read one frame header (its payload, if any, is left on the socket for the caller)."""
    lenbuf = bytearray(4)
    recv_exact(sock, memoryview(lenbuf), idle_ok=idle_ok)
    (n,) = _LEN.unpack(lenbuf)
    if n == 0 or n > MAX_HEADER:
        raise ConnectionError(f"bad frame header length {n}")
    header = bytearray()
    while len(header) < n:  # grown as it arrives, never to the announced length up front
        chunk = bytearray(min(n - len(header), max(PEEK, len(header))))
        recv_exact(sock, memoryview(chunk))
        header += chunk
    return decode(memoryview(header))


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and discard ``nbytes`` of payload (rejected writes, reads nobody waits for)."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK) or 1))
    while nbytes > 0:
        k = min(nbytes, scratch.nbytes)
        recv_exact(sock, scratch[:k])
        nbytes -= k


def frame_parts(msg: Message, payload: memoryview | None = None) -> list[memoryview]:
    """The iovec pieces of one frame, for `send_parts`."""
    head = memoryview(pack(msg))
    return [head] if payload is None else [head, payload]


def send_parts(sock: socket.socket, parts: list[memoryview]) -> None:
    """Send every piece, in order, with as few ``sendmsg`` calls as the kernel allows. On a
    socket in timeout mode (its descriptor is non-blocking) the first try is one ``writev``
    of the descriptor: CPython would poll before every ``sendmsg`` of such a socket, a second
    system call per frame though the send buffer almost always has room."""
    i = 0
    if type(sock) is socket.socket and sock.gettimeout():
        with contextlib.suppress(BlockingIOError):
            i = _sent(parts, 0, os.writev(sock.fileno(), parts[:IOV_MAX]))
    while i < len(parts):
        i = _sent(parts, i, sock.sendmsg(parts[i:i + IOV_MAX]))


def _sent(parts: list[memoryview], i: int, sent: int) -> int:
    """Index of the first piece not wholly sent once ``sent`` more bytes left from piece
    ``i`` on (that piece is cut to what is left of it)."""
    while i < len(parts) and sent >= parts[i].nbytes:
        sent -= parts[i].nbytes
        i += 1
    if sent:
        parts[i] = parts[i][sent:]
    return i


class FrameReader:
    """Buffered frame reader over one socket (used by one thread)."""

    def __init__(self, sock: socket.socket, size: int = 4 * PEEK, spin_s: float = 0.0) -> None:
        self.sock = sock
        self.spin_s = spin_s
        """Payloads are received spinning (`spin_scatter`) for up to this long without progress."""
        self._buf = bytearray(size)
        self._mv = memoryview(self._buf)
        self._start = 0
        self._end = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    def has_frame(self) -> bool:
        """Whether a complete header is already buffered (reading it will not block)."""
        if self.buffered < 4:
            return False
        (n,) = _LEN.unpack_from(self._buf, self._start)
        return self.buffered >= 4 + n

    def _fill(self, need: int, idle_ok: bool) -> None:
        """Buffer at least ``need`` bytes; the buffer grows only as bytes arrive (doubling,
        never past ``need``), not to ``need`` up front."""
        if self._start + need > len(self._buf):
            n = self.buffered
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        while self._end - self._start < need:
            if self._end == len(self._buf):  # full of what arrived: make room for more
                self._mv.release()
                self._buf = self._buf + bytearray(min(len(self._buf), need - self._end))
                self._mv = memoryview(self._buf)
            room = min(len(self._buf) - self._end, max(PEEK, need - self.buffered))
            try:
                k = self.sock.recv_into(self._mv[self._end:self._end + room], room)
            except TimeoutError:
                if idle_ok and self._end == self._start:
                    raise IdleTimeout("idle") from None
                raise
            if k == 0:
                raise PeerClosed("peer closed the connection")
            self._end += k

    def _consume(self, n: int) -> None:
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0

    def read(self, idle_ok: bool = False, within_s: float = 0.0) -> Message:
        """The next frame's header (its payload, if any, must be read next). With
        ``within_s``, the header must be complete that long after its length arrived
        (`TimeoutError` otherwise: a peer trickling a header is cut, not waited for)."""
        self._fill(4, idle_ok)
        (n,) = _LEN.unpack_from(self._buf, self._start)
        if n == 0 or n > MAX_HEADER:
            raise ConnectionError(f"bad frame header length {n}")
        if within_s and self.buffered < 4 + n:
            sock = self.sock
            timeout = sock.gettimeout()
            self.sock = DeadlineSocket(  # type: ignore[assignment]
                sock, time.monotonic() + within_s,
                why=f"a frame header of {n} bytes still arriving {within_s}s after it began")
            try:
                self._fill(4 + n, False)
            finally:
                self.sock = sock
                sock.settimeout(timeout)
        self._fill(4 + n, False)
        msg = decode(self._mv[self._start + 4:self._start + 4 + n])
        self._consume(4 + n)
        return msg

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next payload bytes (buffered ones first, then straight from
        the socket)."""
        k = min(self.buffered, view.nbytes)
        if k:
            view[:k] = self._mv[self._start:self._start + k]
            self._consume(k)
        if k < view.nbytes:
            recv_exact(self.sock, view[k:])

    def read_into_many(self, views: list[memoryview]) -> None:
        """Fill every view in order with the next payload bytes: buffered ones first, then
        scattered straight from the socket with ``recvmsg_into`` (many views per call)."""
        i, n = 0, len(views)
        while i < n and self.buffered:
            v = views[i]
            k = min(self.buffered, v.nbytes)
            v[:k] = self._mv[self._start:self._start + k]
            self._consume(k)
            if k < v.nbytes:
                views = [v[k:], *views[i + 1:]]
                i, n = 0, len(views)
            else:
                i += 1
        views = views[i:]
        if views and self.spin_s:  # a long run: take what is there, then sleep once (_Lowat)
            long = sum(v.nbytes for v in views) > LOWAT_MIN
            views = spin_scatter(self.sock, views, 0.0 if long else self.spin_s)
        if views:
            recv_scatter(self.sock, views)

    def skip(self, nbytes: int) -> None:
        """Discard the next ``nbytes`` payload bytes."""
        k = min(self.buffered, nbytes)
        self._consume(k)
        if k < nbytes:
            drain(self.sock, nbytes - k)


class DeadlineSocket:
    """A socket as `FrameReader` / `send_parts` use it, with every call bounded by one absolute
    deadline ``end`` (monotonic; also the bound `spin_scatter` honours) and at most ``cap_s``
    each: a socket timeout applies per call, so a peer trickling a few bytes at a time would
    otherwise stretch an exchange far past its deadline. Used by the inline TCP path (the
    batch deadline) and the server's receiving of a write payload (its fence).

    Over a non-blocking socket (``settimeout(0)``, the inline path's) a call is made at once
    and only one that would block waits, in one ``poll`` bounded by what is left: one system
    call per send or receive. Over a socket in timeout mode each call first sets the timeout to
    what is left (an ``ioctl``, and CPython polls before every call of a socket with a
    timeout)."""

    def __init__(self, sock: socket.socket, end: float = 0.0, cap_s: float | None = None,
                 why: str = "socket exchange ran past its deadline") -> None:
        self.sock = sock
        self.end = end
        self.cap_s = cap_s
        self.why = why
        self.armed = False
        """Whether a call changed the socket's timeout (its owner restores it only then: a
        ``settimeout`` is a system call)."""
        self._polls: dict[int, select.poll] = {}

    def _arm(self) -> None:
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(self.why)
        self.armed = True
        self.sock.settimeout(left if self.cap_s is None else min(left, self.cap_s))

    def wait_readable(self) -> None:
        """Sleep until the (non-blocking) socket is readable, within the deadline: for a
        caller that knows the answer is not there yet (a receive would fail first)."""
        self._wait(select.POLLIN)

    def _wait(self, events: int) -> None:
        """Wait until the non-blocking socket is ready for ``events``, within what is left of
        ``end`` and at most ``cap_s``; `TimeoutError` past either."""
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(self.why)
        cap = left if self.cap_s is None else min(left, self.cap_s)
        p = self._polls.get(events)
        if p is None:
            p = self._polls[events] = select.poll()
            p.register(self.sock, events)
        if not p.poll(max(1, int(cap * 1000 + 0.999))):
            raise TimeoutError(self.why if cap == left else "socket call timed out")

    def _call(self, fn: Any, events: int, *args: Any) -> Any:
        if self.sock.gettimeout() != 0.0:
            self._arm()
            return fn(*args)
        if self.end <= time.monotonic():
            raise TimeoutError(self.why)
        while True:
            try:
                return fn(*args)
            except BlockingIOError:
                self._wait(events)

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, *args: Any) -> int:
        return self._call(self.sock.recv_into, select.POLLIN, *args)

    def recvmsg_into(self, *args: Any) -> tuple[int, Any, int, Any]:
        return self._call(self.sock.recvmsg_into, select.POLLIN, *args)

    def sendmsg(self, *args: Any) -> int:
        return self._call(self.sock.sendmsg, select.POLLOUT, *args)

    def sendall(self, data: Any) -> None:
        if self.sock.gettimeout() != 0.0:
            self._arm()
            self.sock.sendall(data)
            return
        view = memoryview(data).cast("B")
        while view.nbytes:
            view = view[self._call(self.sock.send, select.POLLOUT, view):]
