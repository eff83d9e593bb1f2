"""Coalesced frames: grouping of slices into frames, scatter receive, one batch update per
frame, and a frame mixing accepted and refused slices (each request ends on its own status)."""

from __future__ import annotations

import socket
import threading

import msgspec
import numpy as np
import pytest

from yuebing.core.errors import ConfigError
from yuebing.protocol.transfer import Hello, HelloReply, ReadSlices, SlicesDone, WriteSlices
from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)
from yuebing.transfer.batch import Batch, RequestState, Slice, complete_slices
from yuebing.transfer.transport.framing import (
    FrameReader,
    PeerClosed,
    recv_frame,
    recv_scatter,
    send_frame,
)
from yuebing.transfer.transport.lane_ops import NotifyOp, group_frames
from yuebing.transfer.transport.tcp_server import MAX_FRAME_SLICES

SIZE = 1 << 16


def _batch(n: int) -> Batch:
    return Batch(1, [RequestState(OpCode.WRITE, 4, 1) for _ in range(n)], deadline=1e18)


def test_frames_group_runs_of_same_segment_and_direction() -> None:
    b = _batch(5)
    mv = memoryview(bytearray(4))
    w_a = [Slice(b, i, OpCode.WRITE, mv, "a", 4 * i) for i in range(2)]
    r_a = Slice(b, 2, OpCode.READ, mv, "a", 8)
    w_b = Slice(b, 3, OpCode.WRITE, mv, "b", 0)
    w_a2 = Slice(b, 4, OpCode.WRITE, mv, "a", 16)
    note = NotifyOp("me", "t", b"")
    ops = [*w_a, r_a, w_b, note, w_a2]
    assert group_frames(ops, 1 << 20) == [w_a, [r_a], [w_b], [note], [w_a2]]
    assert group_frames(ops, 4) == [[w_a[0]], [w_a[1]], [r_a], [w_b], [note], [w_a2]]


def test_complete_slices_updates_each_batch_once_per_request() -> None:
    b1, b2 = _batch(2), _batch(1)
    mv = memoryview(bytearray(4))
    slices = [Slice(b1, 0, OpCode.WRITE, mv, "s", 0), Slice(b2, 0, OpCode.WRITE, mv, "s", 0),
              Slice(b1, 1, OpCode.WRITE, mv, "s", 4)]
    complete_slices(slices, [None, "refused", None])
    s1, s2 = b1.snapshot(), b2.snapshot()
    assert [r.status for r in s1.requests] == [TransferStatus.DONE, TransferStatus.DONE]
    assert [r.transferred for r in s1.requests] == [4, 4]
    assert s2.status == TransferStatus.FAILED and s2.requests[0].error == "refused"
    assert b1.event.is_set() and b2.event.is_set()


def test_scatter_receive_fills_views_across_partial_sends() -> None:
    a, b = socket.socketpair()
    try:
        data = bytes(range(256)) * 40  # 10240 bytes
        bufs = [bytearray(n) for n in (1, 4000, 3, 6236)]

        def send() -> None:
            for i in range(0, len(data), 777):  # many small writes: partial receives
                a.sendall(data[i:i + 777])

        t = threading.Thread(target=send)
        t.start()
        recv_scatter(b, [memoryview(x) for x in bufs])
        t.join()
        assert b"".join(bufs) == data
    finally:
        a.close()
        b.close()


def test_reader_scatters_buffered_bytes_first() -> None:
    a, b = socket.socketpair()
    try:
        send_frame(a, SlicesDone(id=3, errors=["", ""]))
        a.sendall(b"abcdefgh")
        reader = FrameReader(b)
        assert reader.read() == SlicesDone(id=3, errors=["", ""])
        out = [bytearray(3), bytearray(5)]
        reader.read_into_many([memoryview(x) for x in out])
        assert out == [bytearray(b"abc"), bytearray(b"defgh")]
    finally:
        a.close()
        b.close()


def test_frame_mixing_accepted_and_refused_slices() -> None:
    """Three requests travel in one frame (one lane); the owner refuses the middle one (a stale
    descriptor lets it past submit): the others complete, nothing of it is written or read."""
    meta = EmbeddedMetadata()
    with TransferEngine(TransferConfig(engine_id="owner"), metadata=meta) as owner:
        owner.register_segment("seg", size=SIZE).array[:] = 7
        desc = meta.lookup("seg")
        assert desc is not None
        meta.publish(msgspec.structs.replace(desc, size=2 * SIZE, shm_path=""))
        cfg = TransferConfig(transports=("tcp",), lanes=1, slice_size=4096)
        with TransferEngine(cfg, metadata=meta) as eng:
            offsets = (0, SIZE, 8192)
            reqs = [TransferRequest(OpCode.WRITE, np.full(4096, i + 1, np.uint8), "seg", off)
                    for i, off in enumerate(offsets)]
            st = eng.wait(eng.submit(reqs), 10)
            assert [r.status for r in st.requests] == [
                TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.DONE]
            assert "refused" in st.requests[1].error and "outside segment 'seg'" in st.requests[1].error
            assert st.status == TransferStatus.FAILED
            outs = [np.zeros(4096, np.uint8) for _ in offsets]
            st = eng.wait(eng.submit([TransferRequest(OpCode.READ, o, "seg", off)
                                      for o, off in zip(outs, offsets, strict=True)]), 10)
            assert [r.status for r in st.requests] == [
                TransferStatus.DONE, TransferStatus.FAILED, TransferStatus.DONE]
            assert (outs[0] == 1).all() and (outs[1] == 0).all() and (outs[2] == 3).all()
        arr = owner.segment("seg").array
        expect = np.full(SIZE, 7, np.uint8)
        expect[:4096], expect[8192:12288] = 1, 3
        assert (arr == expect).all()


@pytest.mark.parametrize("slices", [
    [(0, 0, 0, 0)],  # a zero-length slice: the payload size is unknowable
    [(0, 1, 0, 1)] * (MAX_FRAME_SLICES + 1),
    [],
])
def test_malformed_frame_closes_only_that_lane(slices: list[tuple[int, int, int, int]]) -> None:
    meta = EmbeddedMetadata()
    with TransferEngine(TransferConfig(engine_id="owner"), metadata=meta) as owner:
        owner.register_segment("seg", size=SIZE).array[:] = 7
        host, _, port = owner.address.rpartition(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            send_frame(sock, Hello(engine_id="raw", host_id="h"))
            assert isinstance(recv_frame(sock), HelloReply)
            send_frame(sock, WriteSlices(id=1, segment="seg", slices=slices, expiry=2e9))
            with pytest.raises(PeerClosed):
                recv_frame(sock)
        with TransferEngine(TransferConfig(transports=("tcp",)), metadata=meta) as eng:
            eng.transfer([TransferRequest(OpCode.WRITE, np.full(8, 2, np.uint8), "seg", 0)])
        assert (owner.segment("seg").array[:8] == 2).all()
        assert (owner.segment("seg").array[8:] == 7).all()


def test_frame_over_the_byte_cap_closes_the_lane_with_a_precise_error(caplog) -> None:
    """A peer's read frame asking for more than ``max_frame_bytes`` (here 4 slices of the whole
    segment) is refused before a byte is sent; an engine with the same cap splits its own."""
    cap = SIZE
    meta = EmbeddedMetadata()
    cfg = TransferConfig(engine_id="owner", max_frame_bytes=cap, slice_size=4096,
                         inline_bytes=cap)
    with TransferEngine(cfg, metadata=meta) as owner:
        owner.register_segment("seg", size=SIZE).array[:] = 7
        host, _, port = owner.address.rpartition(":")
        caplog.set_level("DEBUG", logger="yuebing.transfer.transport.tcp_server")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            send_frame(sock, Hello(engine_id="raw", host_id="h"))
            assert isinstance(recv_frame(sock), HelloReply)
            send_frame(sock, ReadSlices(id=1, segment="seg", slices=[(0, SIZE, 0, SIZE)] * 4))
            with pytest.raises(PeerClosed):
                recv_frame(sock)
        assert f"frame of 4 slices moves {4 * SIZE} payload bytes, over the cap of {cap} " \
               "(max_frame_bytes)" in caplog.text
        sender = TransferConfig(transports=("tcp",), lanes=1, slice_size=4096,
                                max_frame_bytes=cap, inline_bytes=cap)
        with TransferEngine(sender, metadata=meta) as eng:
            outs = [np.zeros(SIZE, np.uint8) for _ in range(4)]
            st = eng.wait(eng.submit([TransferRequest(OpCode.READ, o, "seg", 0) for o in outs]), 10)
            assert st.status == TransferStatus.DONE, st.errors
            assert all((o == 7).all() for o in outs)


def test_max_frame_bytes_bounds_slices_and_inline_frames() -> None:
    with pytest.raises(ConfigError, match=r"max_frame_bytes must be in slice_size \(1048576\)"):
        TransferConfig(max_frame_bytes=64 << 10)
    with pytest.raises(ConfigError, match=r"inline_bytes must be in 0..max_frame_bytes"):
        TransferConfig(max_frame_bytes=2 << 20, inline_bytes=4 << 20)
