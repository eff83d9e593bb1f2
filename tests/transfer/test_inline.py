"""The inline TCP path (`submit(..., inline=True)`): small one-direction batches move in the
submitting thread over a dedicated connection; everything else, and anything it cannot finish,
goes through the lanes."""

from __future__ import annotations

import socket
from collections.abc import Callable

import numpy as np
import pytest

from yuebing.core.errors import ConfigError
from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest, TransferStatus
from yuebing.transfer.transport.tcp_client import TcpEndpoint

Make = Callable[..., TransferEngine]


def _pair(make_engine: Make, **kw: object) -> tuple[TransferEngine, TransferEngine, np.ndarray]:
    owner = make_engine(engine_id="owner-i")
    seg = owner.register_segment("inl", size=8 << 20)
    eng = make_engine(transports=("tcp",), lanes=2, slice_size=64 << 10, retry_backoff_s=0.001,
                      **kw)
    return owner, eng, seg.array


def _endpoint(eng: TransferEngine) -> TcpEndpoint:
    (ep,) = [e for _, e in eng._peers.pool.drain()]
    eng._peers.pool.get_or_create(("tcp", "owner-i", ep.address), lambda: ep)
    assert isinstance(ep, TcpEndpoint)
    return ep


def test_inline_write_then_read_is_done_when_submit_returns(make_engine: Make) -> None:
    _, eng, seg = _pair(make_engine, inline_bytes=1 << 20)
    data = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8)  # 5 slices
    bid = eng.submit([TransferRequest(OpCode.WRITE, data, "inl", 4096)], inline=True)
    assert eng.status(bid).status == TransferStatus.DONE  # moved by this thread, no waiting
    eng.free(bid)
    assert np.array_equal(seg[4096:4096 + data.nbytes], data)
    out = np.zeros_like(data)
    bid = eng.submit([TransferRequest(OpCode.READ, out, "inl", 4096)], inline=True)
    assert eng.status(bid).status == TransferStatus.DONE
    assert np.array_equal(out, data)
    ep = _endpoint(eng)
    assert ep._inline is not None
    assert sum(lane.outstanding for lane in ep._lanes) == 0


def test_refused_slice_fails_its_request_only(make_engine: Make) -> None:
    owner, eng, _ = _pair(make_engine, inline_bytes=1 << 20)
    eng.transfer([TransferRequest(OpCode.WRITE, b"a" * 10, "inl", 0)], inline=True)
    ep = _endpoint(eng)
    owner.unregister_segment("inl")  # the owner now refuses; the stale descriptor allows it
    owner.register_segment("inl", size=4096)
    st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, b"b" * 5000, "inl", 0)], inline=True))
    assert st.status == TransferStatus.FAILED
    assert "target" in st.requests[0].error and "refused" in st.requests[0].error
    assert ep._inline is not None  # a refusal is an answer, not a broken connection


def test_broken_inline_connection_retries_on_the_lanes(make_engine: Make) -> None:
    _, eng, seg = _pair(make_engine, inline_bytes=1 << 20)
    eng.transfer([TransferRequest(OpCode.WRITE, b"x", "inl", 0)], inline=True)
    ep = _endpoint(eng)
    assert ep._inline is not None
    ep._inline.sock.shutdown(socket.SHUT_RDWR)  # the next exchange fails on send
    data = np.arange(200_000, dtype=np.uint32).view(np.uint8)[:500_000]
    st = eng.wait(eng.submit([TransferRequest(OpCode.WRITE, data, "inl", 0)], inline=True), 10)
    assert st.status == TransferStatus.DONE, st.errors
    assert np.array_equal(seg[:data.nbytes], data)
    assert ep._inline is None  # dropped; reopened by the next inline batch
    eng.transfer([TransferRequest(OpCode.WRITE, b"y", "inl", 0)], inline=True)
    assert ep._inline is not None and bytes(seg[:1]) == b"y"


def test_blocking_transfer_of_one_frame_moves_inline_by_default(make_engine: Make) -> None:
    _, eng, seg = _pair(make_engine, inline_bytes=64 << 10)
    eng.transfer([TransferRequest(OpCode.WRITE, b"d" * 8, "inl", 64)])  # no lane hand-off
    assert bytes(seg[64:72]) == b"d" * 8
    ep = _endpoint(eng)
    assert ep._inline is not None
    assert sum(lane.outstanding for lane in ep._lanes) == 0


@pytest.mark.parametrize("case", ["mixed", "too_big", "not_asked"])
def test_what_does_not_qualify_goes_through_the_lanes(make_engine: Make, case: str) -> None:
    _, eng, seg = _pair(make_engine, inline_bytes=64 << 10)
    seg[:8] = np.arange(8, dtype=np.uint8)
    out = bytearray(8)
    reqs = {"mixed": [TransferRequest(OpCode.READ, out, "inl", 0),
                      TransferRequest(OpCode.WRITE, b"w" * 8, "inl", 4096)],
            "too_big": [TransferRequest(OpCode.WRITE, b"w" * (64 << 10), "inl", 4096),
                        TransferRequest(OpCode.WRITE, b"w" * 8, "inl", 1 << 20)],
            "not_asked": [TransferRequest(OpCode.WRITE, b"w" * 8, "inl", 4096)]}[case]
    eng.transfer(reqs, inline=case != "not_asked")
    assert bytes(seg[4096:4104]) == b"w" * 8
    if case == "mixed":
        assert out == bytes(range(8))
    assert _endpoint(eng)._inline is None


@pytest.mark.parametrize(("field", "value", "match"), [
    ("inline_bytes", -1, r"inline_bytes must be in 0..max_frame_bytes \(67108864\), got -1"),
    ("spin_us", -5, r"spin_us must be in 0..100000 or -1 \(auto\), got -5"),
])
def test_inline_config_rejects_bad_values(field: str, value: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TransferConfig(**{field: value})  # type: ignore[arg-type]
