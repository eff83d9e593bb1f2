"""Framing of the store's RPC over plain TCP: ``[u32 length][u64 request id][payload]``.

Plain non-blocking sockets under one ``epoll`` loop, not ZeroMQ: about twice as fast per
round trip in Python (no I/O-thread hops), which the master's single-key rate needs. Here: the
frame format, the incremental parser (`FrameBuffer`) and `FrameSocket`, the blocking client
side (to masters; frames up to ``MAX_FRAME``; it may spin ``spin_s`` before it blocks,
`Spinner`); the master's side is `wire_server.FrameServer`. Request id 0 marks a push (master →
node task, replication entries). With a cluster token (`core.auth`) a connection starts with
`auth_preamble(token)`; the server reads nothing else until `TokenCheck` accepted it. A
master also listens on a Linux abstract Unix socket named after its TCP address (`local_name`);
a client that dials it on loopback connects there instead (`connect`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import select
import socket
import struct
import sys
import time

from yuebing.core.spin import Spinner

HEADER = struct.Struct("<IQ")
MAX_FRAME = 1 << 30
RECV = 1 << 20
AUTH_MAGIC = b"YBTOKEN1"
AUTH_LEN = len(AUTH_MAGIC) + 32
"""Bytes of `auth_preamble`: what a connection sends first when the cluster has a token."""


def auth_preamble(token: str) -> bytes:
    """The first bytes a client sends on a connection to a master that requires ``token``."""
    return AUTH_MAGIC + hashlib.sha256(b"yuebing-cluster-token\0" + token.encode()).digest()


class TokenCheck:
    """The server's side of `auth_preamble` on one new connection (sans-IO; fed by
    `wire_limits.Intake` with each read of `wire_server.FrameServer` until ``done``): collects
    the first `AUTH_LEN` bytes in a buffer of that size and compares them with ``preamble`` in
    constant time."""

    __slots__ = ("_want", "_got", "done")

    def __init__(self, preamble: bytes) -> None:
        self._want = preamble
        self._got = bytearray()
        self.done = False
        """The whole preamble arrived and matched: what follows is frames."""

    def feed(self, data: memoryview) -> tuple[int, str]:
        """Take the preamble's bytes from ``data``: (bytes taken, why the connection is refused
        — "" while it is incomplete or once it matched)."""
        k = min(len(data), AUTH_LEN - len(self._got))
        self._got += data[:k]
        head = min(len(self._got), len(AUTH_MAGIC))
        if self._got[:head] != AUTH_MAGIC[:head]:
            return k, "no cluster token (the client was started without it)"
        if len(self._got) < AUTH_LEN:
            return k, ""
        if not hmac.compare_digest(bytes(self._got), self._want):
            return k, "wrong cluster token"
        self.done = True
        return k, ""


class FrameTooLarge(ValueError):
    """A header announced a frame over the limit; ``frames`` were complete before it."""

    def __init__(self, rid: int, length: int, limit: int,
                 frames: list[tuple[int, bytes]]) -> None:
        super().__init__(f"frame of {length} bytes exceeds {limit}")
        self.rid, self.length, self.frames = rid, length, frames


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` (or ``host:port``) → (host, port)."""
    rest = address[6:] if address.startswith("tcp://") else address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must look like tcp://127.0.0.1:50151, got {address!r}")
    return host, int(port)


LOCAL_PREFIX = "\0yuebing-store/"


def local_name(host: str, port: int) -> str:
    """The abstract Unix socket name of a master listening on TCP ``host:port``. Linux keeps
    such names per network namespace and drops one with its socket; the master will not start
    while another socket holds its name (`wire_server.FrameServer`), so a name found is the
    live master of that address in this namespace. A round trip through it skips the TCP stack
    (docs/store.md, "Latency knobs and results")."""
    return f"{LOCAL_PREFIX}{host}:{port}"


def local_names(address: str) -> list[str]:
    """The abstract names a master serving ``address`` may listen on: for a loopback address
    (``127.x.x.x``, ``localhost``: what TCP reaches only in this network namespace) its exact
    name, then that of the wildcard ``0.0.0.0`` it may have bound instead, which TCP would
    reach there too; [] for any other address (an address of this host may still be served by
    another, e.g. a virtual one routed elsewhere) and off Linux."""
    host, port = parse_address(address)
    if host == "localhost":
        host = "127.0.0.1"
    if not sys.platform.startswith("linux") or not host.startswith("127."):
        return []
    try:
        socket.inet_aton(host)
    except OSError:
        return []
    return [local_name(host, port), local_name("0.0.0.0", port)]


def peer_cred(sock: socket.socket) -> tuple[int, int]:
    """(pid, user id) of the process at the other end of Unix socket ``sock`` (``struct
    ucred``; uid -1 when it is not connected)."""
    pid, uid, _ = struct.unpack("iIi", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def trusted(sock: socket.socket) -> bool:
    """Whether the listener of local socket ``sock`` may be the master: it runs as this user or
    as root. Anyone may bind a free abstract name; one held by another user is passed over for
    TCP, so no credential goes to it."""
    return peer_cred(sock)[1] in (os.getuid(), 0)


def connect_local(address: str, timeout_s: float) -> socket.socket | None:
    """A socket connected to the master at ``address`` through its abstract Unix socket, if it
    is on loopback and a `trusted` process listens there (`local_names`); else None. It never
    waits: a name nobody listens on is refused, a full backlog fails (EAGAIN), so event loops
    call it too (`AsyncMasterConnection`)."""
    for name in local_names(address):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout_s)
        try:
            s.connect(name)
            if trusted(s):
                return s
        except OSError:
            pass
        s.close()
    return None


def connect(address: str, timeout_s: float, local: bool = True) -> socket.socket:
    """A connected socket to the master at ``address``: through its abstract Unix socket when
    ``local`` and `connect_local` finds it, else TCP (no Nagle delay)."""
    s = connect_local(address, timeout_s) if local else None
    if s is None:
        s = socket.create_connection(parse_address(address), timeout=timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def frame(rid: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), rid) + payload


class FrameBuffer:
    """Incremental parser: feed bytes, take complete ``(rid, payload)`` frames."""

    __slots__ = ("buf", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self.buf = bytearray()
        self.max_frame = max_frame

    def frames(self) -> list[tuple[int, bytes]]:
        """The complete frames buffered; `FrameTooLarge` (carrying those before it, which are
        consumed) when the next header announces more than ``max_frame`` bytes — the buffer
        then starts with that header."""
        out: list[tuple[int, bytes]] = []
        buf = self.buf
        pos = 0
        n = len(buf)
        over: tuple[int, int] | None = None
        with memoryview(buf) as view:  # one copy per payload (a bytearray slice would be two)
            while n - pos >= 12:
                length, rid = HEADER.unpack_from(buf, pos)
                if length > self.max_frame:
                    over = rid, length
                    break
                if n - pos - 12 < length:
                    break
                out.append((rid, bytes(view[pos + 12:pos + 12 + length])))
                pos += 12 + length
        if pos:  # only once the view is released: a bytearray with an export cannot shrink
            del buf[:pos]
        if over is not None:
            raise FrameTooLarge(*over, self.max_frame, out)
        return out


class FrameSocket:
    """Blocking client connection; `call` sends a frame and waits for the matching reply.

    The socket itself stays non-blocking from the start, and waiting is one ``poll`` only when
    a call would block: a Python socket with a timeout polls before every send and receive and
    costs an ``ioctl`` each time its timeout is set, so a round trip was ~6 system calls; it is
    now the send, the wait (spin polls, or one blocking ``poll``) and one ``recv_into``."""

    def __init__(self, address: str, timeout_s: float, spin_s: float = 0.0,
                 token: str = "", local: bool = True) -> None:
        self.address = address
        self.timeout_s = timeout_s
        """Bound of a `send` given no ``timeout_s`` of its own."""
        self.sock = connect(address, timeout_s, local)
        self.local = self.sock.family == socket.AF_UNIX
        """Connected through the master's local socket (`local_name`), not TCP."""
        if token:
            self.sock.sendall(auth_preamble(token))
        self.sock.setblocking(False)
        self.spin_s = spin_s
        self._spinner = Spinner()
        self._poll = select.poll()
        self._poll.register(self.sock, select.POLLIN)
        self._wpoll = select.poll()
        self._wpoll.register(self.sock, select.POLLOUT)
        self.inb = FrameBuffer()
        self.pending: list[tuple[int, bytes]] = []
        self._rbuf = bytearray(RECV)
        self._rview = memoryview(self._rbuf)

    def send(self, rid: int, payload: bytes, before: bytes = b"",
             timeout_s: float | None = None) -> None:
        """Send one frame, preceded in the same system call by the ready frames ``before``;
        `TimeoutError` if it cannot all be sent within ``timeout_s`` (default ``timeout_s``)."""
        self.send_raw(before + HEADER.pack(len(payload), rid) + payload, timeout_s)

    def send_raw(self, data: bytes | memoryview, timeout_s: float | None = None) -> None:
        """Send ``data`` (whole frames): one ``send`` when the socket buffer takes it (a
        request always fits), else waiting for room up to ``timeout_s``."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent == len(data):
            return
        end = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        view = memoryview(data)[sent:]
        while view.nbytes:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"sending to master {self.address} timed out")
            if self._wpoll.poll(max(1, int(left * 1000))):
                with contextlib.suppress(BlockingIOError):
                    view = view[self.sock.send(view):]

    def send_some(self, data: bytes | memoryview) -> int:
        """One non-blocking ``send`` of ``data``: the bytes the socket buffer took (0 when it
        is full); OSError when the connection broke. The rest is the caller's to send."""
        try:
            return self.sock.send(data)
        except BlockingIOError:
            return 0

    def ready(self) -> bool:
        """Whether a frame, or the peer's close, can be taken now without waiting (one poll)."""
        return bool(self.pending) or bool(self._poll.poll(0))

    def recv(self, timeout_s: float) -> tuple[int, bytes] | None:
        """The next frame, or None after ``timeout_s`` (0: only what has already arrived —
        one non-blocking read); raises OSError if the peer closed."""
        if self.pending:
            return self.pending.pop(0)
        wait = timeout_s > 0
        if self.spin_s and wait:  # poll for a quick reply before sleeping for it
            wait = not self._spinner.wait(lambda: self._poll.poll(0), min(self.spin_s, timeout_s))
        end = time.monotonic() + timeout_s
        while True:
            if wait:
                left = end - time.monotonic()
                if left <= 0 or not self._poll.poll(max(1, int(left * 1000 + 0.999))):
                    if time.monotonic() >= end:
                        return None
                    continue
            try:
                n = self.sock.recv_into(self._rbuf)
            except BlockingIOError:
                if timeout_s <= 0:
                    return None
                wait = True
                continue
            if not n:
                raise ConnectionError(f"master {self.address} closed the connection")
            if n >= 12 and not self.inb.buf:  # the usual reply: one whole frame, nothing before
                length, rid = HEADER.unpack_from(self._rbuf)
                if n == 12 + length:
                    return rid, bytes(self._rview[12:n])
            self.inb.buf += self._rview[:n]
            frames = self.inb.frames()
            if frames:
                self.pending.extend(frames[1:])
                return frames[0]
            wait = timeout_s > 0

    def close(self) -> None:
        self.sock.close()
