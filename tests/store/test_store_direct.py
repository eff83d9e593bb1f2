"""Same-host fast path pieces without processes: the liveness lock and the copies."""

from __future__ import annotations

import os
import time

import numpy as np

from yuebing.store.client.direct import SMALL_COPY, _copy, _Mapped, hold_liveness_lock
from yuebing.transfer import OpCode


def test_liveness_lock_and_copies_both_ways(tmp_path) -> None:
    path = tmp_path / "seg"
    size = 2 * SMALL_COPY
    path.write_bytes(bytes(size))
    mapped = _Mapped(str(path), size)
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
