"""`spin_scatter` / `FrameReader(spin_s=...)`: payloads received by non-blocking ``readv`` polling
fill every view in order across many segments, hand back what is left when the peer goes quiet
or the socket's deadline passes (even while bytes still trickle in), and report EOF."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from yuebing.protocol.transfer import SliceAck
from yuebing.transfer.transport import framing
from yuebing.transfer.transport.framing import FrameReader, PeerClosed, spin_scatter


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    b.settimeout(5.0)  # timeout mode: the descriptor is non-blocking, as on real lanes
    yield a, b
    a.close()
    b.close()


class _Deadlined:
    """A socket as the inline path's `DeadlineSocket` shows it: ``fileno`` plus ``end``."""

    def __init__(self, sock: socket.socket, end: float) -> None:
        self.sock, self.end = sock, end

    def fileno(self) -> int:
        return self.sock.fileno()


def _send_later(sock: socket.socket, chunks: list[bytes], gap_s: float) -> threading.Thread:
    def run() -> None:
        for c in chunks:
            time.sleep(gap_s)
            sock.sendall(c)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_fills_views_in_order_across_segments(pair, monkeypatch) -> None:
    """Polling alone fills every view, in order, while the bytes arrive in pieces. The limits
    that end polling early (`SPIN_CAP_S` in all, ``spin_s`` without progress; tested below)
    are lifted: on a loaded CPU the pieces can take longer than 50 ms to arrive, and then the
    rest is left to the caller's blocking receive, as it should be."""
    a, b = pair
    monkeypatch.setattr(framing, "SPIN_CAP_S", 60.0)
    data = bytes(range(256)) * 1024  # 256 KiB
    bufs = [bytearray(100), bytearray(70_000), bytearray(len(data) - 70_100)]
    t = _send_later(a, [data[i:i + 30_000] for i in range(0, len(data), 30_000)], 0.001)
    left = spin_scatter(b, [memoryview(x) for x in bufs], spin_s=30.0)
    assert left == []  # before the join: unread bytes would keep the sender blocked
    t.join(10)
    assert b"".join(bufs) == data


def test_returns_the_rest_when_the_peer_goes_quiet(pair) -> None:
    a, b = pair
    a.sendall(b"x" * 10)
    buf = bytearray(20)
    t0 = time.monotonic()
    left = spin_scatter(b, [memoryview(buf)], spin_s=0.01)
    assert time.monotonic() - t0 < 1.0
    assert [v.nbytes for v in left] == [10]
    assert buf[:10] == b"x" * 10 and buf[10:] == bytes(10)


def test_stops_at_the_socket_deadline_while_bytes_still_trickle(pair) -> None:
    a, b = pair
    buf = bytearray(1000)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            a.sendall(b"y")
            time.sleep(0.0005)
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        left = spin_scatter(_Deadlined(b, t0 + 0.005), [memoryview(buf)], spin_s=0.2)  # type: ignore[arg-type]
        took = time.monotonic() - t0
    finally:
        stop.set()
        t.join()
    assert left and left[0].nbytes > 0
    assert took < framing.SPIN_CAP_S / 2  # the deadline ends it, not the overall spin cap


def test_a_deadline_already_past_reads_nothing(pair) -> None:
    a, b = pair
    a.sendall(b"z" * 8)
    views = [memoryview(bytearray(8))]
    assert spin_scatter(_Deadlined(b, time.monotonic() - 1), views, spin_s=0.2) == views  # type: ignore[arg-type]
    assert bytes(views[0]) == bytes(8)


def test_eof_raises_peer_closed(pair) -> None:
    a, b = pair
    a.sendall(b"abc")
    a.close()
    with pytest.raises(PeerClosed):
        spin_scatter(b, [memoryview(bytearray(10))], spin_s=0.5)


def test_blocking_socket_is_left_to_the_blocking_receive() -> None:
    a, b = socket.socketpair()
    try:
        a.sendall(b"abcd")
        views = [memoryview(bytearray(4))]
        assert spin_scatter(b, views, spin_s=0.5) == views  # nothing read: b has no timeout
    finally:
        a.close()
        b.close()


def test_frame_reader_spinning_receives_a_payload_split_around_the_header(pair, monkeypatch) -> None:
    a, b = pair
    calls = []
    real = framing.spin_scatter
    monkeypatch.setattr(framing, "spin_scatter", lambda *x: calls.append(1) or real(*x))
    payload = bytes(range(256)) * 2048  # 512 KiB: most of it is not in the header read
    framing.send_frame(a, SliceAck(id=7, error=""))
    t = _send_later(a, [payload[:1000], payload[1000:]], 0.001)
    reader = FrameReader(b, spin_s=0.5)
    assert reader.read().id == 7  # type: ignore[attr-defined]
    out = bytearray(len(payload))
    reader.read_into_many([memoryview(out)])
    t.join()
    assert out == payload and calls == [1]
