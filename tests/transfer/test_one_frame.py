"""`TransferEngine.transfer_status`: requests that fit one inline frame move as one frame of
whole requests without batch bookkeeping; a refusal fails only its request, a broken connection
sends them the submit way, and the deadline holds against a peer that stalls (trickling and
dying peers: test_misbehaving_peers.py, on every path)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import numpy as np
import pytest
from fake_peers import ScriptedPeer

from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest, TransferStatus
from yuebing.transfer.transport.tcp_client import TcpEndpoint

Make = Callable[..., TransferEngine]


def _pair(make_engine: Make) -> tuple[TransferEngine, TransferEngine, np.ndarray]:
    owner = make_engine(engine_id="owner-f")
    seg = owner.register_segment("one", size=8 << 20)
    eng = make_engine(transports=("tcp",), lanes=2, slice_size=64 << 10, retry_backoff_s=0.001,
                      inline_bytes=2 << 20)
    return owner, eng, seg.array


def _endpoint(eng: TransferEngine) -> TcpEndpoint:
    (ep,) = [e for _, e in eng._peers.pool.drain()]
    eng._peers.pool.get_or_create(("tcp", "owner-f", ep.address), lambda: ep)
    assert isinstance(ep, TcpEndpoint)
    return ep


def test_requests_move_as_one_frame_of_whole_requests(make_engine: Make) -> None:
    owner, eng, seg = _pair(make_engine)
    rng = np.random.default_rng(5)
    data = [rng.integers(0, 256, n, dtype=np.uint8) for n in (300_000, 7, 200_000)]
    offs = [0, 1 << 20, 3 << 20]
    served = owner._server.served_slices
    st = eng.transfer_status([TransferRequest(OpCode.WRITE, d, "one", o)
                              for d, o in zip(data, offs, strict=True)])
    assert st.status == TransferStatus.DONE, st.errors
    assert [r.transferred for r in st.requests] == [d.nbytes for d in data]
    # whole requests: 3 slices, although the lanes would cut these into 64 KiB pieces (9)
    assert owner._server.served_slices - served == 3
    for d, o in zip(data, offs, strict=True):
        assert np.array_equal(seg[o:o + d.nbytes], d)
    outs = [np.zeros_like(d) for d in data]
    st = eng.transfer_status([TransferRequest(OpCode.READ, b, "one", o)
                              for b, o in zip(outs, offs, strict=True)])
    assert st.status == TransferStatus.DONE, st.errors
    assert all(np.array_equal(a, b) for a, b in zip(outs, data, strict=True))
    ep = _endpoint(eng)
    assert ep._inline is not None and sum(lane.outstanding for lane in ep._lanes) == 0


def test_refused_request_fails_alone_and_the_connection_stays(make_engine: Make) -> None:
    owner, eng, seg = _pair(make_engine)
    eng.transfer_status([TransferRequest(OpCode.WRITE, b"a", "one", 0)])
    owner.unregister_segment("one")  # the owner now refuses; the stale descriptor allows it
    seg = owner.register_segment("one", size=4096).array
    st = eng.transfer_status([TransferRequest(OpCode.WRITE, b"b" * 5000, "one", 0),
                              TransferRequest(OpCode.WRITE, b"c" * 10, "one", 100)])
    assert st.status == TransferStatus.FAILED
    assert [r.status for r in st.requests] == [TransferStatus.FAILED, TransferStatus.DONE]
    assert "refused" in st.requests[0].error and st.requests[0].transferred == 0
    assert bytes(seg[100:110]) == b"c" * 10
    assert _endpoint(eng)._inline is not None  # a refusal is an answer, not a broken connection


def test_broken_connection_moves_the_frame_the_submit_way(make_engine: Make) -> None:
    owner, eng, seg = _pair(make_engine)
    eng.transfer_status([TransferRequest(OpCode.WRITE, b"x", "one", 0)])
    ep = _endpoint(eng)
    broken = ep._inline
    assert broken is not None
    broken.sock.shutdown(socket.SHUT_RDWR)  # the next frame fails on send
    data = np.arange(150_000, dtype=np.uint32).view(np.uint8)
    served = owner._server.served_slices
    st = eng.transfer_status([TransferRequest(OpCode.WRITE, data, "one", 0)], timeout_s=10)
    assert st.status == TransferStatus.DONE, st.errors
    assert np.array_equal(seg[:data.nbytes], data)
    assert owner._server.served_slices - served == 10  # submitted: 64 KiB slices
    assert ep._inline is not broken  # dropped (the submit way opened a new one)
    eng.transfer_status([TransferRequest(OpCode.WRITE, b"y", "one", 0)])
    assert ep._inline is not None and bytes(seg[:1]) == b"y"


@pytest.mark.parametrize("case", ["two_segments", "mixed", "too_big", "not_inline"])
def test_what_is_not_one_frame_goes_the_submit_way(make_engine: Make, case: str) -> None:
    owner, eng, seg = _pair(make_engine)
    seg2 = owner.register_segment("two", size=1 << 20).array
    seg[:8] = np.arange(8, dtype=np.uint8)
    out = bytearray(8)
    reqs = {"two_segments": [TransferRequest(OpCode.WRITE, b"w" * 8, "one", 4096),
                             TransferRequest(OpCode.WRITE, b"v" * 8, "two", 0)],
            "mixed": [TransferRequest(OpCode.READ, out, "one", 0),
                      TransferRequest(OpCode.WRITE, b"w" * 8, "one", 4096)],
            "too_big": [TransferRequest(OpCode.WRITE, b"w" * (2 << 20), "one", 1 << 20),
                        TransferRequest(OpCode.WRITE, b"w" * 8, "one", 4096)],
            "not_inline": [TransferRequest(OpCode.WRITE, b"w" * 8, "one", 4096)]}[case]
    st = eng.transfer_status(reqs, inline=case != "not_inline")
    assert st.status == TransferStatus.DONE, st.errors
    assert bytes(seg[4096:4104]) == b"w" * 8
    if case == "two_segments":
        assert bytes(seg2[:8]) == b"v" * 8
    if case == "mixed":
        assert out == bytes(range(8))
    assert _endpoint(eng)._inline is None  # all through the lanes


def test_stalled_peer_times_out_at_the_deadline() -> None:
    peer = ScriptedPeer(engine_id="staller")  # handshakes, then never answers
    with TransferEngine(TransferConfig(transports=("tcp",)),
                        metadata=peer.metadata("stuck")) as eng:
        t0 = time.monotonic()
        st = eng.transfer_status([TransferRequest(OpCode.READ, bytearray(4096), "stuck", 0)],
                                 timeout_s=0.3)
        elapsed = time.monotonic() - t0
        assert st.status == TransferStatus.TIMEOUT
        assert "deadline passed" in st.requests[0].error
        assert 0.3 <= elapsed < 1.0
    peer.close()
