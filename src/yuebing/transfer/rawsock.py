"""The raw Python socket RPC that ``yuebing bench transfer --raw`` and ``yuebing bench store
--raw`` hold TCP against: a put (``sendall`` of a header and the payload, an 8-byte answer once
the server ``recv_into``'d all of it) and a get (a header; the payload ``recv_into``'d).

`RawServer` runs the server (``python -m yuebing.transfer.rawsock BYTES``: one buffer of
BYTES, a thread per connection) as a child process; `RawClient` makes the calls, from and into
the caller's views at the offsets the engine uses, so both walk the same working set.
`interleave` alternates rounds of two measurements and reports medians and their spread.
"""

from __future__ import annotations

import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_REQ = struct.Struct("<BQQ")  # op (1 put, 2 get), size, offset in the server's buffer
_ACK = struct.Struct("<Q")
PUT, GET = 1, 2


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("raw socket peer closed")
        got += k


def _tune(sock: socket.socket, buffer_bytes: int) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def _serve_conn(conn: socket.socket, buf: memoryview) -> None:
    head = memoryview(bytearray(_REQ.size))
    with conn:
        while True:
            try:
                _recv_exact(conn, head)
            except (ConnectionError, OSError):
                return
            op, size, offset = _REQ.unpack(head)
            if offset + size > buf.nbytes:
                return  # a bad request ends the connection (the client is ours)
            if op == PUT:
                _recv_exact(conn, buf[offset:offset + size])
                conn.sendall(_ACK.pack(size))
            else:
                conn.sendall(buf[offset:offset + size])


def serve(nbytes: int, buffer_bytes: int) -> None:
    """Body of the server process: print the listening port, serve until stdin closes."""
    buf = memoryview(bytearray(b"\1" * nbytes))  # every page touched: no faults are timed
    ls = socket.create_server(("127.0.0.1", 0))
    print(ls.getsockname()[1], flush=True)

    def accept() -> None:
        while True:
            conn, _ = ls.accept()
            _tune(conn, buffer_bytes)
            threading.Thread(target=_serve_conn, args=(conn, buf), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    sys.stdin.read()


class RawServer:
    """The server child process; `close` (stdin closed) ends it."""

    def __init__(self, nbytes: int, buffer_bytes: int = 0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "yuebing.transfer.rawsock", str(nbytes), str(buffer_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line:
            self.proc.kill()
            raise RuntimeError(f"raw socket server exited with {self.proc.wait()} before serving")
        self.port = int(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawClient:
    """One connection to a `RawServer`."""

    def __init__(self, port: int, buffer_bytes: int = 0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        _tune(self.sock, buffer_bytes)
        self._ack = memoryview(bytearray(_ACK.size))

    def put(self, view: memoryview, offset: int) -> None:
        self.sock.sendall(_REQ.pack(PUT, view.nbytes, offset))
        self.sock.sendall(view)
        _recv_exact(self.sock, self._ack)

    def get(self, view: memoryview, offset: int) -> None:
        self.sock.sendall(_REQ.pack(GET, view.nbytes, offset))
        _recv_exact(self.sock, view)

    def close(self) -> None:
        self.sock.close()


def rpc_loop(client: RawClient, op: str, views: list[memoryview], duration_s: float,
             min_calls: int = 3) -> tuple[list[float], float]:
    """Call ``op`` ("put"/"write" or "get"/"read") on each view in turn (view i at offset
    i × its size) for ``duration_s`` (at least ``min_calls``); returns latencies and elapsed."""
    call = client.put if op in ("put", "write") else client.get
    lat: list[float] = []
    start = now = time.perf_counter()
    i = 0
    while now < start + duration_s or len(lat) < min_calls:
        v = views[i % len(views)]
        t0 = time.perf_counter()
        call(v, (i % len(views)) * v.nbytes)
        now = time.perf_counter()
        lat.append(now - t0)
        i += 1
    return lat, now - start


@dataclass(frozen=True)
class Interleaved:
    """Two measurements alternated for some rounds: each one's median rate, and the ratio
    a ÷ b per round (median, lowest, highest)."""

    a: float
    b: float
    ratio: float
    ratio_min: float
    ratio_max: float
    rounds: int


def interleave(a: Callable[[], float], b: Callable[[], float], rounds: int) -> Interleaved:
    """Run ``a`` then ``b`` (each returns a rate) ``rounds`` times, alternating which goes first
    so neither always follows the other's cache and scheduler state."""
    ra: list[float] = []
    rb: list[float] = []
    for r in range(rounds):
        if r % 2:
            rb.append(b())
            ra.append(a())
        else:
            ra.append(a())
            rb.append(b())
    ratios = [x / y if y else 0.0 for x, y in zip(ra, rb, strict=True)]
    return Interleaved(statistics.median(ra), statistics.median(rb), statistics.median(ratios),
                       min(ratios), max(ratios), rounds)


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)
