"""The master's RPC port bounds what peers make it hold (issue 15, item 1): frames over the
port's limit are refused without being buffered (dropped as they arrive, the sender told; far
over it, the connection cut), a frame trickling in is cut at its deadline, and incomplete frames
across connections share one memory budget. In-process `FrameServer` rules, then the balloon
scenario at small scale against a real master process (bounded RSS, clear log, still serving)."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from yuebing.store.wire import HEADER, FrameSocket
from yuebing.store.wire_limits import FrameLimits
from yuebing.store.wire_server import FrameServer

KiB = 1024


class Echo:
    """A `FrameServer` answering each frame with its length; refusals recorded."""

    def __init__(self, limits: FrameLimits) -> None:
        self.refused: list[tuple[int, str]] = []
        self.srv = FrameServer("tcp://127.0.0.1:0", self._on_frame, 0.0, limits,
                               lambda cid, rid, why: self._refuse(cid, rid, why))

    def _on_frame(self, cid: int, rid: int, payload: bytes) -> None:
        self.srv.send(cid, rid, str(len(payload)).encode())

    def _refuse(self, cid: int, rid: int, why: str) -> None:
        self.refused.append((rid, why))
        self.srv.send(cid, rid, b"refused")

    def serve_until(self, done: object, timeout_s: float = 5.0) -> None:
        end = time.monotonic() + timeout_s
        while not done() and time.monotonic() < end:  # type: ignore[operator]
            self.srv.poll(0.01)


def raw(srv: FrameServer) -> socket.socket:
    host, port = srv.address[6:].rsplit(":", 1)
    return socket.create_connection((host, int(port)))


def closed(s: socket.socket) -> bool:
    s.settimeout(0.0)
    try:
        return s.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def test_an_oversized_frame_is_dropped_unbuffered_and_answered() -> None:
    e = Echo(FrameLimits(max_frame=64 * KiB, budget=256 * KiB, discard_max=1 << 20))
    c = FrameSocket(e.srv.address, 5.0)
    try:
        c.sock.sendall(HEADER.pack(512 * KiB, 7))
        for _ in range(8):  # 512 KiB streamed in pieces: none of it is kept
            c.sock.sendall(b"x" * (64 * KiB))
            e.srv.poll(0.05)
            assert e.srv.buffered == 0
        e.serve_until(lambda: e.refused)
        assert e.refused[0][0] == 7 and "512 KiB" not in e.refused[0][1]
        assert "request of 524288 bytes exceeds this port's limit of 65536" in e.refused[0][1]
        assert c.recv(2.0) == (7, b"refused")
        c.send(8, b"abc")  # the connection still serves
        e.serve_until(lambda: c.ready())
        assert c.recv(2.0) == (8, b"3")
    finally:
        c.close()
        e.srv.close()


def test_a_frame_far_over_the_limit_cuts_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    e = Echo(FrameLimits(max_frame=64 * KiB, budget=256 * KiB, discard_max=1 << 20))
    s = raw(e.srv)
    try:
        with caplog.at_level(logging.WARNING, "yuebing.store.wire_limits"):
            s.sendall(HEADER.pack((1 << 30) - 1, 1) + b"y" * 1000)
            e.serve_until(lambda: e.srv.cut)
        assert e.srv.cut == 1 and not e.srv.conns and e.srv.buffered == 0
        assert "a frame of 1073741823 bytes was announced" in caplog.text
        end = time.monotonic() + 5
        while not closed(s):  # the server closed its end: the close reaches us
            assert time.monotonic() < end, "the connection stayed open"
            time.sleep(0.01)
    finally:
        s.close()
        e.srv.close()


def test_a_trickling_frame_is_cut_at_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    e = Echo(FrameLimits(max_frame=64 * KiB, budget=256 * KiB, frame_timeout_s=0.3))
    s = raw(e.srv)
    try:
        with caplog.at_level(logging.WARNING, "yuebing.store.wire_limits"):
            s.sendall(HEADER.pack(1000, 1) + b"z")
            for _ in range(40):  # a byte every 50 ms: each read is within any I/O timeout
                if e.srv.cut:
                    break
                s.sendall(b"z")
                e.serve_until(lambda: False, 0.05)
        assert e.srv.cut == 1 and not e.srv.conns
        assert "a frame still incomplete" in caplog.text
    finally:
        s.close()
        e.srv.close()


def test_requests_streamed_back_to_back_are_not_cut() -> None:
    """Each send ends one frame and starts the next, so something is always buffered: the
    deadline counts from each frame's start, not from the first."""
    e = Echo(FrameLimits(max_frame=64 * KiB, budget=256 * KiB, frame_timeout_s=0.3))
    s = raw(e.srv)
    try:
        one = HEADER.pack(100, 1) + b"a" * 100
        s.sendall(one[:50])
        for _ in range(12):  # 1.2 s in all, 0.1 s per frame
            s.sendall(one[50:] + one[:50])
            e.serve_until(lambda: False, 0.1)
        assert e.srv.cut == 0 and len(e.srv.conns) == 1
    finally:
        s.close()
        e.srv.close()


def test_incomplete_frames_share_one_budget(caplog: pytest.LogCaptureFixture) -> None:
    e = Echo(FrameLimits(max_frame=64 * KiB, budget=128 * KiB))
    socks = [raw(e.srv) for _ in range(4)]
    try:
        with caplog.at_level(logging.WARNING, "yuebing.store.wire_limits"):
            for i, s in enumerate(socks):  # each holds ~60 KiB of a 64 KiB frame
                s.sendall(HEADER.pack(64 * KiB - 12, i) + b"p" * (60 * KiB + i))
                e.serve_until(lambda: False, 0.1)
        assert e.srv.buffered <= 128 * KiB
        assert e.srv.cut == 2 and len(e.srv.conns) == 2
        assert "held by all connections (budget 131072)" in caplog.text
    finally:
        for s in socks:
            s.close()
        e.srv.close()


def test_a_peer_that_does_not_read_its_replies_is_not_read_from() -> None:
    e = Echo(FrameLimits(max_frame=4 * KiB, budget=64 * KiB))
    big = b"r" * 3000
    e.srv.on_frame = lambda cid, rid, p: e.srv.send(cid, rid, big)  # type: ignore[assignment]
    s = raw(e.srv)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"".join(HEADER.pack(1, i) + b"q" for i in range(5000)))
        e.serve_until(lambda: False, 1.0)
        (c,) = e.srv.conns.values()
        assert c.paused and len(c.out) <= 4 * KiB + len(big) + 12
    finally:
        s.close()
        e.srv.close()


# ---------------------------------------------------------------------------- real master
def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_balloon_against_a_master_process_is_cut_and_it_keeps_serving() -> None:
    """The issue's probe (connections announcing a frame just under 1 GiB, then streaming),
    scaled down, against a master with its default limits (8 MiB per request)."""
    from store_procs import master

    from yuebing.protocol import store as m
    from yuebing.store.client.client import StoreClient
    from yuebing.store.client.rpc import StoreRpcError
    from yuebing.store.config import ClientConfig

    mst = master()
    try:
        addr = mst.info["address"]
        host, port = addr[6:].rsplit(":", 1)
        with StoreClient(ClientConfig(master=addr)) as c:
            c.stats()
            before = _rss_mib(mst.proc.pid)
            chunk = b"\0" * (1 << 20)
            for length, mib in [((1 << 30) - 64, 64)] * 3 + [(40 << 20, 40)] * 4:
                s = socket.create_connection((host, int(port)))
                s.sendall(HEADER.pack(length, 1))  # ~1 GiB: cut; 40 MiB: read and dropped
                try:
                    for _ in range(mib):
                        s.sendall(chunk)
                except OSError:
                    pass  # cut: what the master should do
                finally:
                    s.close()
            grew = _rss_mib(mst.proc.pid) - before
            assert grew < 32, f"master RSS grew {grew:.0f} MiB"
            with pytest.raises(StoreRpcError) as err:  # an honest oversized batch: told why
                c.batch_exists([f"key/{i:09d}" for i in range(700_000)])
            assert err.value.code == m.Code.BAD_REQUEST
            assert "exceeds this port's limit of 8388608 bytes" in str(err.value)
            assert c.batch_exists(["a", "b"]) == [False, False]  # and it keeps serving
    finally:
        mst.stop()
        out = mst.proc.stdout.read().decode() if mst.proc.stdout else ""
    assert "a frame of 1073741760 bytes was announced" in out, out[-2000:]
