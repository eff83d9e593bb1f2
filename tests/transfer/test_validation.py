"""Range validation: out-of-range and unregistered accesses are rejected with an error and
nothing is written — at submit (against the descriptor) and by the owner (against its table)."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import pytest

from yuebing.core.errors import InputError, TransferError
from yuebing.transfer import (
    EmbeddedMetadata,
    OpCode,
    TransferConfig,
    TransferEngine,
    TransferRequest,
    TransferStatus,
)

SIZE = 1 << 16


@pytest.fixture
def pair() -> tuple[TransferEngine, TransferEngine, EmbeddedMetadata]:
    meta = EmbeddedMetadata()
    owner = TransferEngine(TransferConfig(engine_id="owner"), metadata=meta)
    owner.register_segment("seg", size=SIZE).array[:] = 7
    yield owner, meta
    owner.close()


def _initiator(meta: EmbeddedMetadata, transport: str) -> TransferEngine:
    return TransferEngine(TransferConfig(transports=(transport,), slice_size=4096), metadata=meta)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_submit_rejects_out_of_range_and_unknown_and_writes_nothing(pair, transport) -> None:
    owner, meta = pair
    with _initiator(meta, transport) as eng:
        good = TransferRequest(OpCode.WRITE, np.ones(100, np.uint8), "seg", 0)
        cases = [
            (TransferRequest(OpCode.WRITE, np.ones(100, np.uint8), "seg", SIZE - 50),
             TransferError, rf"access \[{SIZE - 50}, {SIZE + 50}\) is outside segment 'seg'"),
            (TransferRequest(OpCode.WRITE, np.ones(100, np.uint8), "nope", 0),
             TransferError, "segment 'nope' is not registered by any engine"),
            (TransferRequest(OpCode.READ, bytes(100), "seg", 0), InputError, "writable"),
        ]
        for bad, exc, match in cases:
            with pytest.raises(exc, match=match):
                eng.submit([good, bad])  # the good request must not move either
        assert (owner.segment("seg").array == 7).all()
        assert eng.stats()["batches"] == 0


def _forge(meta: EmbeddedMetadata, name: str, **changes: object) -> None:
    desc = meta.lookup("seg")
    assert desc is not None
    meta.publish(msgspec.structs.replace(desc, name=name, **changes))


@pytest.mark.parametrize(("name", "size", "offset", "expect"), [
    ("seg", 2 * SIZE, SIZE - 4096, f"outside segment 'seg' of {SIZE} bytes"),
    ("ghost", SIZE, 0, "segment 'ghost' is not registered on the target"),
])
def test_owner_rejects_what_a_stale_descriptor_allows(pair, name, size, offset, expect) -> None:
    """A peer with wrong metadata still cannot write outside the owner's registered ranges."""
    owner, meta = pair
    _forge(meta, name, size=size, shm_path="")
    with _initiator(meta, "tcp") as eng:
        payload = np.full(8192, 1, np.uint8)
        bid = eng.submit([TransferRequest(OpCode.WRITE, payload, name, offset)])
        st = eng.wait(bid, 10)
        assert st.status == TransferStatus.FAILED
        assert expect in st.requests[0].error and "refused" in st.requests[0].error
        out = np.zeros(8192, np.uint8)
        st = eng.wait(eng.submit([TransferRequest(OpCode.READ, out, name, offset)]), 10)
        assert st.status == TransferStatus.FAILED and expect in st.requests[0].error
        assert (out == 0).all()
        # the lane survives a refused request: a valid one on the same endpoint succeeds
        eng.transfer([TransferRequest(OpCode.WRITE, np.full(16, 3, np.uint8), "seg", 0)])
    arr = owner.segment("seg").array
    assert (arr[:16] == 3).all() and (arr[16:] == 7).all()


def test_shm_rejects_descriptor_larger_than_the_mapping(pair) -> None:
    owner, meta = pair
    _forge(meta, "big", size=4 * SIZE)
    with _initiator(meta, "shm") as eng:
        bid = eng.submit([TransferRequest(OpCode.WRITE, np.ones(16, np.uint8), "big", 0)])
        st = eng.wait(bid, 10)
        assert st.status == TransferStatus.FAILED
        assert "smaller than its descriptor says" in st.requests[0].error
    assert (owner.segment("seg").array == 7).all()


def test_local_engine_rejects_after_unregister(make_engine: Callable[..., TransferEngine]) -> None:
    eng = make_engine()
    eng.register_segment("mine", buffer=np.zeros(64, np.uint8))
    eng.transfer([TransferRequest(OpCode.WRITE, b"x" * 8, "mine", 0)])
    assert bytes(eng.segment("mine").view[:8]) == b"x" * 8
    eng.unregister_segment("mine")
    with pytest.raises(TransferError, match="not registered"):
        eng.submit([TransferRequest(OpCode.WRITE, b"x" * 8, "mine", 0)])
    with pytest.raises(InputError, match="already registered"):
        eng.register_segment("dup", size=4096)
        eng.register_segment("dup", size=4096)


def test_register_segment_argument_errors(make_engine: Callable[..., TransferEngine]) -> None:
    eng = make_engine()
    with pytest.raises(InputError, match="exactly one of size= or buffer="):
        eng.register_segment("a")
    with pytest.raises(InputError, match="segment name"):
        eng.register_segment("bad name!", size=4096)
    with pytest.raises(InputError, match="positive"):
        eng.register_segment("z", size=0)
    with pytest.raises(InputError, match="unknown batch id 99"):
        eng.status(99)  # type: ignore[arg-type]
