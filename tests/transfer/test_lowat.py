"""Long payload runs are received with ``SO_RCVLOWAT`` at what is still missing (`recv_scatter`,
`FrameReader.read_into_many`): the run completes when the kernel's receive buffer is far
smaller than it (the mark is lowered as bytes arrive, never left above what the peer still
owes), the mark is back at 1 afterwards (also after EOF), and the next small frame is read."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from yuebing.protocol.transfer import SliceAck
from yuebing.transfer.transport.framing import (
    LOWAT_MIN,
    LOWAT_PARTS,
    FrameReader,
    PeerClosed,
    recv_scatter,
    send_frame,
)


@pytest.fixture
def tcp_pair():
    srv = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(srv.getsockname())
    b, _ = srv.accept()
    srv.close()
    b.settimeout(5.0)  # a hang (a mark above what is owed) fails the test instead
    yield a, b
    a.close()
    b.close()


def _mark(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def _send(sock: socket.socket, data: bytes) -> threading.Thread:
    t = threading.Thread(target=sock.sendall, args=(data,), daemon=True)
    t.start()
    return t


def test_long_run_through_a_small_receive_buffer(tcp_pair) -> None:
    a, b = tcp_pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # mark clamped far below the run
    data = bytes(range(256)) * 4096 + b"tail"  # 1 MiB + 4: the last bytes arrive alone
    bufs = [bytearray(3), bytearray(LOWAT_MIN + 1), bytearray(len(data) - LOWAT_MIN - 4)]
    t = _send(a, data)
    recv_scatter(b, [memoryview(x) for x in bufs])
    t.join()
    assert b"".join(bufs) == data
    assert _mark(b) == 1


def test_mark_is_reset_after_eof(tcp_pair) -> None:
    a, b = tcp_pair
    a.sendall(b"x" * 1000)
    a.close()
    with pytest.raises(PeerClosed):
        recv_scatter(b, [memoryview(bytearray(4 * LOWAT_MIN))])
    assert _mark(b) == 1


def _spy_marks(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """Every receive low-water mark set from now on, in order."""
    marks: list[int] = []
    real = socket.socket.setsockopt

    def spy(self, level, opt, value):  # type: ignore[no-untyped-def]
        if opt == socket.SO_RCVLOWAT:
            marks.append(value)
        return real(self, level, opt, value)

    monkeypatch.setattr(socket.socket, "setsockopt", spy)
    return marks


def test_short_run_leaves_the_mark_alone(tcp_pair, monkeypatch) -> None:
    a, b = tcp_pair
    marks = _spy_marks(monkeypatch)
    a.sendall(b"y" * LOWAT_MIN)
    out = bytearray(LOWAT_MIN)
    recv_scatter(b, [memoryview(out)])
    assert out == b"y" * LOWAT_MIN and marks == []
    data = b"z" * (2 * LOWAT_MIN)
    t = _send(a, data)
    out = bytearray(len(data))
    recv_scatter(b, [memoryview(out)])
    t.join()
    # the mark: what is missing, at most a quarter of the receive buffer as it was then
    assert out == data and 1 < marks[0] <= len(data) and marks[-1] == 1


def test_a_long_run_wakes_the_receiver_by_parts(tcp_pair, monkeypatch) -> None:
    """The mark is a part of the run (`LOWAT_PARTS`), not all of it: the receiver copies each
    part out while the sender still sends the next, so only the last part's copy trails."""
    a, b = tcp_pair
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # the buffer does not clamp it
    data = bytes(range(256)) * 4096  # 1 MiB
    if b.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4 < len(data) // LOWAT_PARTS:
        pytest.skip("net.core.rmem_max clamps the receive buffer below what a part needs")
    marks = _spy_marks(monkeypatch)
    t = _send(a, data)
    out = bytearray(len(data))
    recv_scatter(b, [memoryview(out)])
    t.join()
    assert out == data and marks[0] == len(data) // LOWAT_PARTS and marks[-1] == 1
    assert max(marks) == len(data) // LOWAT_PARTS


@pytest.mark.parametrize("spin_s", [0.0, 0.05])
def test_frame_reader_long_payload_then_a_small_frame(tcp_pair, spin_s: float) -> None:
    a, b = tcp_pair
    payload = bytes(range(256)) * 3000  # 750 KiB
    send_frame(a, SliceAck(id=1, error=""), memoryview(payload))
    reader = FrameReader(b, spin_s=spin_s)
    assert reader.read().id == 1  # type: ignore[attr-defined]
    out = bytearray(len(payload))
    reader.read_into_many([memoryview(out)])
    assert out == payload and _mark(b) == 1
    send_frame(a, SliceAck(id=2, error=""))  # would never wake a receiver left at a high mark
    assert reader.read().id == 2  # type: ignore[attr-defined]


def test_a_lane_sends_a_run_of_reads_as_one_frame_and_writes_by_the_mib() -> None:
    from types import SimpleNamespace

    from yuebing.transfer.transport.tcp_lane import COALESCE_BYTES, Lane
    from yuebing.transfer.types import OpCode

    reads = [SimpleNamespace(op=OpCode.READ, length=COALESCE_BYTES) for _ in range(16)]
    writes = [SimpleNamespace(op=OpCode.WRITE, length=COALESCE_BYTES) for _ in range(16)]
    assert Lane._take(reads) == (reads, [])  # type: ignore[arg-type]
    assert Lane._take(writes) == (writes[:1], writes[1:])  # type: ignore[arg-type]
    assert Lane._take(writes, 256, 4 * COALESCE_BYTES) == (writes[:4], writes[4:])  # type: ignore[arg-type]


def test_inline_answer_to_a_long_write_is_slept_for_not_spun_for() -> None:
    from yuebing.transfer.transport.tcp_inline import InlineConn

    a, b = socket.socketpair()
    conn = InlineConn(b, "peer", io_timeout_s=5.0, spin_s=0.01, max_frame_bytes=1 << 20)
    spun: list[float] = []

    class Spy:
        def wait(self, poll, window):  # type: ignore[no-untyped-def]
            spun.append(window)

    conn._spinner = Spy()  # type: ignore[assignment]
    try:  # nothing to read yet: it sleeps in poll until its deadline (the old code returned)
        conn._timed.end = time.monotonic() + 0.05
        with pytest.raises(TimeoutError):
            conn._await_reply(LOWAT_MIN + 1)
        a.sendall(b"x")  # an answer arriving: the sleep ends
        conn._timed.end = time.monotonic() + 5.0
        conn._await_reply(LOWAT_MIN + 1)
        conn._await_reply(LOWAT_MIN + 1, first=False)  # a later frame's: straight to the read
        assert spun == []
        conn._await_reply(LOWAT_MIN)
        conn._await_reply(0)  # a read's request frame carries no payload
        assert spun == [0.01, 0.01]
    finally:
        conn.close()
        a.close()
