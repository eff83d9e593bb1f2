"""A data port (a transfer engine's TCP server, which store nodes serve their segments on)
allocates nothing for what a header announces before the bytes arrive, and bounds each part of
a frame by a deadline rather than each receive call (issue 15, item 1): a peer announcing a
large header and trickling it, or trickling a refused slice's payload, is cut."""

from __future__ import annotations

import contextlib
import socket
import time

from yuebing.protocol.transfer import Hello, HelloReply, WriteSlices
from yuebing.transfer import TransferConfig, TransferEngine
from yuebing.transfer.transport.framing import MAX_HEADER, FrameReader, pack, recv_frame, send_frame

IO_S = 0.5


def test_a_large_announced_header_is_not_allocated_before_it_arrives() -> None:
    a, b = socket.socketpair()
    try:
        b.settimeout(0.2)
        reader = FrameReader(b)
        a.sendall((MAX_HEADER).to_bytes(4, "little") + b"h" * 1000)
        with contextlib.suppress(TimeoutError):
            reader.read()
        assert len(reader._buf) < 1 << 20  # was MAX_HEADER (4 MiB) + its 64 KiB at once
    finally:
        a.close()
        b.close()


def _engine() -> TransferEngine:
    return TransferEngine(TransferConfig(transports=("tcp",), io_timeout_s=IO_S))


def _hello(eng: TransferEngine) -> socket.socket:
    host, port = eng.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=5.0)
    send_frame(s, Hello(engine_id="prober", host_id="elsewhere"))
    assert isinstance(recv_frame(s), HelloReply)
    return s


def _trickle_until_cut(s: socket.socket, seconds: float) -> float:
    """Send a byte every 0.1 s (each within any per-call timeout); seconds until the server
    closed the connection, or ``seconds`` if it never did."""
    t0 = time.monotonic()
    s.settimeout(0.1)
    while time.monotonic() - t0 < seconds:
        try:
            s.sendall(b"t")
            if s.recv(1 << 16) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return seconds


def test_a_trickled_header_is_cut_at_its_deadline() -> None:
    with _engine() as eng:
        s = _hello(eng)
        try:
            s.sendall((1000).to_bytes(4, "little") + b"x")
            assert _trickle_until_cut(s, 8 * IO_S) < 8 * IO_S
        finally:
            s.close()


def test_a_trickled_refused_payload_is_cut_at_its_deadline() -> None:
    with _engine() as eng:
        eng.register_segment("seg", size=1 << 20, prefault=False)
        s = _hello(eng)
        try:  # expired long ago: refused whole, its 64 MiB payload is to be dropped
            frame = WriteSlices(id=1, segment="seg", slices=[(0, 64 << 20, 0, 64 << 20)],
                                expiry=time.time() - 60)
            s.sendall(pack(frame))
            assert _trickle_until_cut(s, 8 * IO_S) < 8 * IO_S
        finally:
            s.close()
