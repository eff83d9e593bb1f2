"""The write fence on the target: a write frame whose expiry passed before the target started
it is refused and writes nothing; an accepted frame still trickling in at expiry + grace closes
the lane and writes nothing more; the shared-memory copy stops at the deadline."""

from __future__ import annotations

import contextlib
import socket
import time

import numpy as np
import pytest

from yuebing.protocol.transfer import Hello, HelloReply, SlicesDone, WriteSlices
from yuebing.transfer import EmbeddedMetadata, OpCode, TransferConfig, TransferEngine
from yuebing.transfer.batch import Batch, RequestState, Slice
from yuebing.transfer.transport.framing import PeerClosed, pack, recv_frame, send_frame
from yuebing.transfer.transport.lane_ops import frame_iovec
from yuebing.transfer.transport.shm import FENCE_CHUNK, copy_slice

SIZE = 1 << 16


def _owner(**kw: object) -> TransferEngine:
    eng = TransferEngine(TransferConfig(engine_id="owner", **kw),  # type: ignore[arg-type]
                         metadata=EmbeddedMetadata())
    eng.register_segment("seg", size=SIZE).array[:] = 7
    return eng


def _lane(owner: TransferEngine) -> socket.socket:
    host, _, port = owner.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    send_frame(sock, Hello(engine_id="raw", host_id="h"))
    assert isinstance(recv_frame(sock), HelloReply)
    return sock


def test_expired_write_frame_is_refused_and_writes_nothing() -> None:
    with _owner() as owner, _lane(owner) as sock:
        late = WriteSlices(id=1, segment="seg", slices=[(0, 4096, 0, 4096), (4096, 4096, 0, 8192)],
                           expiry=time.time() - 0.5)
        sock.sendall(pack(late) + b"\x01" * 8192)
        done = recv_frame(sock)
        assert isinstance(done, SlicesDone) and len(done.errors) == 2
        assert all("expired" in e for e in done.errors)
        # the lane stays usable: a frame within its expiry is written
        sock.sendall(pack(WriteSlices(id=2, segment="seg", slices=[(8192, 16, 8192, 16)],
                                      expiry=time.time() + 10)) + b"\x02" * 16)
        ok = recv_frame(sock)
        assert isinstance(ok, SlicesDone) and ok.errors == [""]
        arr = owner.segment("seg").array
        assert (arr[:8192] == 7).all() and (arr[8192:8208] == 2).all() and (arr[8208:] == 7).all()


def test_trickling_write_is_cut_at_expiry_plus_grace() -> None:
    with _owner(write_grace_s=0.2) as owner, _lane(owner) as sock:
        t0 = time.time()
        sock.sendall(pack(WriteSlices(id=1, segment="seg", slices=[(0, 4096, 0, 4096)],
                                      expiry=t0 + 0.2)) + b"\x03" * 1024)
        sent, closed_at = 1024, None
        while sent < 4096:
            time.sleep(0.05)
            try:
                sock.sendall(b"\x04" * 64)
            except OSError:
                closed_at = time.time()
                break
            sent += 64
            sock.settimeout(0.001)
            try:
                if sock.recv(1) == b"":
                    closed_at = time.time()
                    break
            except TimeoutError:
                pass
            except OSError:
                closed_at = time.time()
                break
        assert closed_at is not None, "the target kept receiving the trickle to the end"
        assert closed_at - t0 < 0.8  # expiry 0.2 s + grace 0.2 s (+ scheduling slack)
        arr = owner.segment("seg").array
        assert (arr[1024 + 64 * 12:4096] == 7).all()  # nothing sent after ~0.6 s landed
        assert (arr[4096:] == 7).all()


def test_old_unfenced_write_frame_fails_the_lane_clearly() -> None:
    with _owner() as owner, _lane(owner) as sock:
        import msgspec

        old = msgspec.msgpack.encode({"type": "transfer.writev", "v": 1, "id": 1,
                                      "segment": "seg", "slices": [(0, 16, 0, 16)]})
        sock.sendall(len(old).to_bytes(4, "little") + old + b"\x05" * 16)
        with pytest.raises((PeerClosed, ConnectionError)):
            recv_frame(sock)
        assert (owner.segment("seg").array == 7).all()


def _slice(length: int, deadline: float) -> Slice:
    batch = Batch(1, [RequestState(OpCode.WRITE, length, 1)], deadline=deadline)
    return Slice(batch, 0, OpCode.WRITE, memoryview(bytearray(b"\x09" * length)), "seg", 0)


def test_frame_expiry_is_the_earliest_batch_deadline_in_wall_time() -> None:
    a, b = _slice(16, time.monotonic() + 5), _slice(16, time.monotonic() + 2)
    head = bytes(frame_iovec(0, [a, b])[0])  # type: ignore[list-item]
    from yuebing.protocol import decode

    msg = decode(head[4:])
    assert isinstance(msg, WriteSlices)
    assert abs(msg.expiry - (time.time() + 2)) < 0.05


def test_shm_copy_stops_at_the_deadline() -> None:
    remote = np.full(3 * FENCE_CHUNK, 7, np.uint8)
    late = _slice(3 * FENCE_CHUNK, time.monotonic() - 0.01)
    assert "expired" in (copy_slice(late, remote, memoryview(remote)) or "")
    assert (remote == 7).all()
    ok = _slice(3 * FENCE_CHUNK, time.monotonic() + 30)
    assert copy_slice(ok, remote, memoryview(remote)) is None and (remote == 9).all()


@pytest.mark.parametrize("expiry", [float("nan"), float("inf")])
def test_non_finite_expiry_breaks_the_lane_and_writes_nothing(expiry: float) -> None:
    with _owner() as owner, _lane(owner) as sock:
        sock.sendall(pack(WriteSlices(id=1, segment="seg", slices=[(0, 16, 0, 16)],
                                      expiry=expiry)) + b"\x05" * 16)
        sock.settimeout(5)
        with pytest.raises((PeerClosed, ConnectionError)):
            recv_frame(sock)
        assert (owner.segment("seg").array == 7).all()


def test_accepted_slice_after_refused_ones_past_the_fence_is_not_written() -> None:
    """A refused slice's payload is skipped; if that takes the frame past expiry + grace, the
    accepted slice after it must not be written (the lane closes instead)."""
    with _owner(write_grace_s=0.2) as owner, _lane(owner) as sock:
        frame = WriteSlices(id=1, segment="seg", slices=[(SIZE, 4096, 0, 4096),  # out of range
                                                         (0, 16, 0, 16)],
                            expiry=time.time() + 0.1)
        sock.sendall(pack(frame) + b"\x06" * 1024)  # part of the refused slice, then stall
        time.sleep(0.5)  # past expiry + grace
        with contextlib.suppress(OSError):
            sock.sendall(b"\x06" * 3072 + b"\x08" * 16)
        sock.settimeout(5)
        with pytest.raises((PeerClosed, ConnectionError)):
            recv_frame(sock)
        assert (owner.segment("seg").array == 7).all()


def test_land_past_the_fence_writes_nothing_even_from_buffered_bytes() -> None:
    """The payload of an accepted slice already sits in the reader's buffer (it came with the
    header), but the frame reached it past expiry + grace (refused slices skipped before it, a
    stalled thread): nothing may be copied."""
    from yuebing.transfer.transport.framing import FrameReader

    with _owner() as owner:
        a, b = socket.socketpair()
        with a, b:
            b.settimeout(5)
            a.sendall(pack(Hello(engine_id="x", host_id="h")) + b"\x09" * 16)
            reader = FrameReader(b)
            reader.read()
            assert reader.buffered == 16
            view = owner.segment("seg").array[:16].data.cast("B")
            with pytest.raises(TimeoutError):
                owner._server._land(reader, [view], time.time() - 1)
            assert (owner.segment("seg").array == 7).all()
