"""Same-host fast path pieces without processes: the liveness lock and the copies."""

from __future__ import annotations

import fcntl
import os
import time

import numpy as np

from yuebing.store.client.direct import _copy
from yuebing.transfer import OpCode, streamcopy
from yuebing.transfer.liveness import MappedFile


def hold_liveness_lock(path: str) -> int:
    """Lock ``path`` as its owner does (`liveness.create_owned_file`); the fd holds the lock."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


SMALL_COPY = streamcopy.small_copy()
"""This machine's small-copy limit of writes: copies above it stream."""
READ_LIMIT = streamcopy.small_copy(read=True)
"""The same of reads."""


def test_liveness_lock_and_copies_both_ways(tmp_path) -> None:
    path = tmp_path / "seg"
    size = 2 * SMALL_COPY
    path.write_bytes(bytes(size))
    mapped = MappedFile(str(path), size)
    try:
        assert mapped.owner_alive() is False  # nobody holds the file: treated as a dead node
        fd = hold_liveness_lock(str(path))
        assert mapped.owner_alive() is True
        big = np.arange(SMALL_COPY + 1, dtype=np.uint32).view(np.uint8)[:SMALL_COPY + 1]
        later = time.monotonic() + 30
        # past its deadline a write copies nothing (the write fence); a read is not fenced
        assert _copy(OpCode.WRITE, memoryview(b"late!"), mapped, 0, 5, time.monotonic()) == 0
        assert _copy(OpCode.WRITE, memoryview(big), mapped, 10, big.nbytes, later) == big.nbytes
        _copy(OpCode.WRITE, memoryview(b"hello"), mapped, 0, 5, later)  # memoryview path
        out = bytearray(big.nbytes)
        _copy(OpCode.READ, memoryview(out), mapped, 10, big.nbytes, 0.0)
        small = bytearray(5)
        _copy(OpCode.READ, memoryview(small), mapped, 0, 5, 0.0)
        assert bytes(out) == big.tobytes() and small == b"hello"
        os.close(fd)
        assert mapped.owner_alive() is False
    finally:
        mapped.close()
    assert path.read_bytes()[:5] == b"hello"
    assert path.read_bytes()[10:10 + big.nbytes] == big.tobytes()


class _Desc:
    def __init__(self, path: str, size: int) -> None:
        self.shm_path, self.host_id, self.size = path, "here", size


class _Engine:
    """What `DirectSegments` asks of the transfer engine: transports and segment descriptors."""

    host_id = "here"

    def __init__(self, path: str, size: int) -> None:
        self.config = type("Cfg", (), {"transports": ("shm", "tcp")})()
        self.desc = _Desc(path, size)

    def describe(self, segment: str) -> _Desc:
        return self.desc


def test_a_read_ending_past_its_deadline_is_not_trusted(tmp_path) -> None:
    """A direct read that ends past its deadline (the read lease, less a margin) reports
    TIMEOUT — the lease may have ended mid-copy and the range hold another value — so the
    client asks for the replicas again; one within its deadline is DONE."""
    from yuebing.store.client.direct import LATE_READ, DirectSegments
    from yuebing.transfer import TransferRequest, TransferStatus

    path = tmp_path / "seg"
    size = 4 * READ_LIMIT
    path.write_bytes(bytes(range(256)) * (size // 256))
    fd = hold_liveness_lock(str(path))
    direct = DirectSegments(_Engine(str(path), size))  # type: ignore[arg-type]
    try:
        for n in (5, 2 * READ_LIMIT):  # memoryview and streamed copies
            out = bytearray(n)
            req = TransferRequest(OpCode.READ, memoryview(out), "seg", 256, n)
            (late,) = direct.copy([req], time.monotonic() - 1e-3)
            assert late is not None and late.status == TransferStatus.TIMEOUT
            assert late.error == LATE_READ
            (ok,) = direct.copy([req], time.monotonic() + 30)
            assert ok is not None and ok.status == TransferStatus.DONE
            assert bytes(out) == path.read_bytes()[256:256 + n]
    finally:
        direct.close()
        os.close(fd)
