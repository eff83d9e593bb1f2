"""Peers that trickle, break mid-payload or stall next to healthy ones, and requests that end
while waiting for a retry: deadlines hold on every path, nothing is lost, and nothing is sent
after the caller was told the request ended (regressions from a review of the inline path)."""

from __future__ import annotations

import socket
import time

import pytest
from fake_peers import ScriptedPeer

from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)


def _read(eng: TransferEngine, segment: str, timeout_s: float, path: str) -> TransferStatus:
    """One 4 KiB read the given way: through the lanes ("lanes"), the inline batch path
    ("inline"), or `transfer_status`'s one frame of whole requests ("frame")."""
    req = [TransferRequest(OpCode.READ, bytearray(4096), segment, 0)]
    if path == "frame":
        return eng.transfer_status(req, timeout_s=timeout_s)
    return eng.wait(eng.submit(req, timeout_s=timeout_s, inline=path == "inline"), 10)


@pytest.mark.parametrize("path", ["lanes", "inline", "frame"])
def test_trickling_peer_cannot_hold_a_read_past_its_deadline(path: str) -> None:
    def trickle(conn: socket.socket, n: int) -> None:
        for _ in range(n // 256):
            if peer.stop.is_set():
                return
            conn.sendall(b"z" * 256)
            time.sleep(0.1)

    peer = ScriptedPeer(trickle)
    with TransferEngine(TransferConfig(transports=("tcp",), lanes=1),
                        metadata=peer.metadata()) as eng:
        t0 = time.monotonic()
        st = _read(eng, "scripted", 0.3, path)
        assert st.status == TransferStatus.TIMEOUT
        assert time.monotonic() - t0 < 0.8  # 16 trickles would take 1.6 s
    peer.close()


@pytest.mark.parametrize("path", ["lanes", "inline", "frame"])
def test_read_broken_mid_payload_fails_at_once_not_at_the_deadline(path: str) -> None:
    def half_then_die(conn: socket.socket, n: int) -> None:
        conn.sendall(b"h" * (n // 40))
        conn.shutdown(socket.SHUT_RDWR)
        raise OSError("peer died")

    peer = ScriptedPeer(half_then_die)
    with TransferEngine(TransferConfig(transports=("tcp",), lanes=1, retry_backoff_s=0.001,
                                       max_retries=1), metadata=peer.metadata()) as eng:
        t0 = time.monotonic()
        st = _read(eng, "scripted", 5, path)
        assert st.status == TransferStatus.FAILED, st.requests[0].error
        assert "broke" in st.requests[0].error
        assert time.monotonic() - t0 < 2.0  # the deadline is 5 s
    peer.close()


def test_stalled_peer_does_not_hold_up_a_healthy_one_in_the_same_inline_batch() -> None:
    stalled = ScriptedPeer(engine_id="staller")  # handshakes, then never answers
    meta = stalled.metadata("stuck")
    with TransferEngine(TransferConfig(transports=("tcp",), engine_id="owner"),
                        metadata=meta) as owner, \
            TransferEngine(TransferConfig(transports=("tcp",)), metadata=meta) as eng:
        owner.register_segment("good", size=1 << 20).array[:4] = [1, 2, 3, 4]
        good = bytearray(4)
        st = eng.wait(eng.submit([TransferRequest(OpCode.READ, bytearray(4096), "stuck", 0),
                                  TransferRequest(OpCode.READ, good, "good", 0)],
                                 timeout_s=0.5, inline=True), 5)
        assert [r.status for r in st.requests] == [TransferStatus.TIMEOUT, TransferStatus.DONE]
        assert bytes(good) == b"\x01\x02\x03\x04"
    stalled.close()


def test_a_write_whose_request_ended_during_the_retry_backoff_is_never_sent() -> None:
    meta = EmbeddedMetadata()
    with TransferEngine(TransferConfig(transports=("tcp",), engine_id="owner"),
                        metadata=meta) as owner, \
            TransferEngine(TransferConfig(transports=("tcp",), lanes=1, retry_backoff_s=0.3),
                           metadata=meta) as eng:
        seg = owner.register_segment("victim", size=1 << 20)
        eng.transfer([TransferRequest(OpCode.WRITE, b"x", "victim", 0)], inline=True)
        (ep,) = [e for _, e in eng._peers.pool.drain()]
        eng._peers.pool.get_or_create(("tcp", "owner", ep.address), lambda: ep)
        ep._inline.sock.shutdown(socket.SHUT_RDWR)  # the inline connection breaks: retry later
        buf = bytearray(b"A" * 4096)
        st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, buf, "victim", 8192)],
                                 timeout_s=0.1, inline=True), 5)
        assert st.status == TransferStatus.TIMEOUT
        buf[:] = b"S" * 4096  # the caller reuses its buffer, as the store does after a revoke
        time.sleep(0.6)  # past the retry backoff
        assert bytes(seg.array[8192:8200]) == b"\x00" * 8
