"""Integral numpy scalars are accepted wherever the transfer engine takes an int (issue 15,
item 14): KV offsets are computed with numpy. Non-integers are still refused precisely."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from yuebing.core.errors import InputError
from yuebing.transfer import OpCode, TransferEngine, TransferRequest
from yuebing.transfer.types import as_int


@pytest.mark.parametrize("kind", [np.int64, np.int32, np.uint64, np.uint16, np.intp])
def test_numpy_integer_offsets_and_lengths_move_bytes(kind: type, make_engine: Callable) -> None:
    owner = make_engine(engine_id=f"own-{kind.__name__}")
    seg = owner.register_segment(f"np-{kind.__name__}", size=kind(1 << 14))
    assert seg.size == 1 << 14
    peer = make_engine(engine_id=f"peer-{kind.__name__}", transports=("tcp",))
    data = np.arange(300, dtype=np.uint8)
    offsets = np.arange(0, 4096, 1024, dtype=kind)  # e.g. block offsets computed by numpy
    peer.transfer([TransferRequest(OpCode.WRITE, data, seg.name, off, kind(200))
                   for off in offsets])
    for off in offsets:
        assert (seg.array[int(off):int(off) + 200] == data[:200]).all()
        assert seg.array[int(off) + 200] == 0
    out = np.zeros(200, np.uint8)
    req = TransferRequest(OpCode.READ, out, seg.name, offsets[2], kind(200))
    assert type(req.offset) is int and type(req.length) is int  # stored as ints
    peer.transfer([req])
    assert (out == data[:200]).all()


@pytest.mark.parametrize("bad", [1.0, np.float64(8), True, np.bool_(True), "8",
                                 np.array([1, 2]), None])
def test_non_integer_offsets_are_refused(bad: object, make_engine: Callable) -> None:
    owner = make_engine()
    owner.register_segment("refuse", size=4096)
    with pytest.raises(InputError, match="remote offset must be a non-negative int"):
        owner.submit([TransferRequest(OpCode.WRITE, b"x", "refuse", bad)])  # type: ignore[arg-type]


def test_negative_numpy_values_and_bad_sizes_are_refused(make_engine: Callable) -> None:
    owner = make_engine()
    owner.register_segment("neg", size=4096)
    with pytest.raises(InputError, match="remote offset must be a non-negative int"):
        owner.submit([TransferRequest(OpCode.WRITE, b"x", "neg", np.int64(-1))])
    with pytest.raises(InputError, match="length must be a positive int"):
        owner.submit([TransferRequest(OpCode.WRITE, b"x", "neg", 0, np.int64(0))])
    with pytest.raises(InputError, match="segment size must be a positive int"):
        owner.register_segment("zero", size=np.int64(0))
    with pytest.raises(InputError, match="segment size must be a positive int"):
        owner.register_segment("float", size=4096.0)  # type: ignore[arg-type]
    assert as_int(np.uint8(7), "x") == 7 and type(as_int(np.int64(7), "x")) is int


def test_a_transfer_engine_accepts_numpy_timeouts(make_engine: Callable) -> None:
    owner: TransferEngine = make_engine()
    seg = owner.register_segment("t", size=4096)
    owner.transfer([TransferRequest(OpCode.WRITE, b"abc", "t", np.int64(5))],
                   timeout_s=np.float64(5.0))  # type: ignore[arg-type]
    assert bytes(seg.view[5:8]) == b"abc"
