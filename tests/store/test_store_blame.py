"""Which segments a failed put names in its revoke (the master then stops placing on them until
their node heartbeats again): a write cut by the put's own write expiry — before it started, or
a same-host copy mid-way — blames nobody (the client was late, the nodes are fine)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from yuebing.core.errors import TransferError
from yuebing.store.client import direct, puts
from yuebing.store.config import ClientConfig
from yuebing.transfer import OpCode, TransferRequest, TransferStatus
from yuebing.transfer.transport.shm import expired_write
from yuebing.transfer.types import RequestStatus

BUF = np.zeros(64, dtype=np.uint8)


def _reqs(*segments: str) -> list[TransferRequest]:
    return [TransferRequest(OpCode.WRITE, BUF, s, 0, 64) for s in segments]


def test_failed_and_engine_timeouts_are_blamed_late_local_copies_are_not() -> None:
    reqs = _reqs("a", "b", "c", "d")
    sts = [RequestStatus(TransferStatus.DONE, 64, 64),
           RequestStatus(TransferStatus.FAILED, 0, 64, "connection refused"),
           RequestStatus(TransferStatus.TIMEOUT, 0, 64, "batch timed out"),
           RequestStatus(TransferStatus.TIMEOUT, 16, 64, expired_write(16, 64))]
    assert puts.failed_segments(reqs, sts) == ["b", "c", "d"]
    assert puts.blamed_segments(reqs, sts) == ["b", "c"]


def test_a_write_expiry_passed_before_the_transfer_blames_nobody() -> None:
    cfg = ClientConfig()
    with pytest.raises(direct.WriteExpired) as e:
        direct.transfer_timeout(cfg, time.monotonic() - 0.01)
    reqs = _reqs("a", "b")
    assert puts.failed_segments(reqs, None) == ["a", "b"]  # still revoked and retried
    assert puts.blamed_segments(reqs, None, e.value) == []
    assert puts.blamed_segments(reqs, None, TransferError("engine closed")) == ["a", "b"]


def test_a_late_client_revokes_without_naming_the_healthy_node() -> None:
    """End to end: a client whose write time is used up before it writes revokes its puts
    naming no segment, so the master keeps placing on the (healthy) node."""
    from store_procs import store_cluster

    from yuebing.core.errors import StoreError
    from yuebing.protocol import store as m
    from yuebing.store.client.client import StoreClient

    with store_cluster("blame") as (mst, _):
        late = StoreClient(ClientConfig(master=mst.info["address"], transfer_timeout_s=1e-6,
                                        reserve_ahead=False, inline_max_bytes=0),
                           heartbeat=False)  # a write to the node, not a value the master holds
        revokes: list[m.Message] = []
        call = late.rpc.call

        def recording(msg: m.Message) -> m.Message:
            if isinstance(msg, (m.PutRevoke, m.BatchPutRevoke)):
                revokes.append(msg)
            return call(msg)

        late.rpc.call = recording  # type: ignore[method-assign]
        with late, pytest.raises(StoreError, match="put revoked"):
            late.put("k", b"x" * 4096)
        assert revokes and all(r.failed == [] for r in revokes)  # type: ignore[attr-defined]
        with StoreClient(ClientConfig(master=mst.info["address"], inline_max_bytes=0),
                         heartbeat=False) as ok:
            ok.put("k2", b"y" * 4096)  # the node was not marked suspect
            assert bytes(ok.get("k2")) == b"y" * 4096
