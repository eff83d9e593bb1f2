"""Frame I/O on a lane socket: ``[u32 header length][msgpack header][payload bytes]``.

Used by both ends of a TCP lane (`tcp_client`, `tcp_server`) from their own threads. Payloads are
never copied: writes go out with ``sendmsg`` straight from the caller's buffer, reads land with
``recv_into`` straight in registered memory.
"""

from __future__ import annotations

import socket
import struct

from yuebing.protocol import Message, decode, encode

_LEN = struct.Struct("<I")
MAX_HEADER = 4 << 20
_DRAIN_CHUNK = 1 << 20


class IdleTimeout(TimeoutError):
    """The socket timed out before the first byte of a frame: the lane is idle, not broken."""


class PeerClosed(ConnectionError):
    """The peer closed the connection."""


def tune_socket(sock: socket.socket, buffer_bytes: int, timeout_s: float | None) -> None:
    """TCP_NODELAY, large kernel buffers, and an I/O timeout."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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


def recv_frame(sock: socket.socket, idle_ok: bool = False) -> Message:
    """Read one frame header (its payload, if any, is left on the socket for the caller)."""
    lenbuf = bytearray(4)
    recv_exact(sock, memoryview(lenbuf), idle_ok=idle_ok)
    (n,) = _LEN.unpack(lenbuf)
    if n == 0 or n > MAX_HEADER:
        raise ConnectionError(f"bad frame header length {n}")
    header = bytearray(n)
    recv_exact(sock, memoryview(header))
    return decode(header)


def drain(sock: socket.socket, nbytes: int) -> None:
    """Read and discard ``nbytes`` of payload (rejected writes, reads nobody waits for)."""
    scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK) or 1))
    while nbytes > 0:
        k = min(nbytes, scratch.nbytes)
        recv_exact(sock, scratch[:k])
        nbytes -= k
