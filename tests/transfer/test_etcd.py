"""etcd-backed discovery with a real etcd (Debian etcd-server on free loopback ports)."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from etcd_util import EtcdServer, etcd_server  # noqa: F401 - fixture
from yuebing.core.errors import TransferError
from yuebing.transfer import EtcdMetadata, OpCode, TransferRequest, TransferStatus

pytestmark = pytest.mark.etcd


def test_engines_find_each_other_through_etcd(etcd_server: EtcdServer, spawn_peer,  # noqa: F811
                                              make_engine) -> None:
    url = "etcd://" + etcd_server.url.removeprefix("http://")
    peer = spawn_peer(4 << 20, metadata=url, name="etcd-peer")
    assert peer.name == "etcd-peer"  # no host:port in the name: etcd resolves it
    eng = make_engine(metadata=url, transports=("tcp",))
    eng.register_segment("etcd-reply", size=4096)
    desc = eng.describe("etcd-peer")
    assert desc.engine_id == "proc-etcd-peer" and desc.size == 4 << 20
    assert sorted(eng.metadata.names()) == ["etcd-peer", "etcd-reply"]
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    eng.transfer([TransferRequest(OpCode.WRITE, data, "etcd-peer", 4096)], timeout_s=20)
    eng.notify("etcd-peer", "sum", f"4096 {3 << 20} etcd-reply".encode())
    note = eng.next_notify(10)
    assert note is not None
    assert note.payload.decode() == hashlib.blake2b(data, digest_size=16).hexdigest()
    # a stopped peer withdraws its segment (lease revoked on close)
    peer.stop()
    fresh = EtcdMetadata(url)
    try:
        deadline = time.monotonic() + 5
        while fresh.lookup("etcd-peer") is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fresh.lookup("etcd-peer") is None
        assert fresh.names() == ["etcd-reply"]
    finally:
        fresh.close()
    out = np.zeros(16, np.uint8)
    st = eng.wait(eng.submit([TransferRequest(OpCode.READ, out, "etcd-peer", 0)]), 10)
    assert st.status == TransferStatus.FAILED  # cached descriptor, dead owner: clear failure


def test_crashed_engine_segments_expire_with_the_lease(etcd_server: EtcdServer) -> None:  # noqa: F811
    url = "etcd://" + etcd_server.url.removeprefix("http://")
    from yuebing.transfer import SegmentDescriptor

    crashed = EtcdMetadata(url, ttl_s=1)
    crashed.publish(SegmentDescriptor(name="tmp-seg", engine_id="x", host_id="h",
                                      address="127.0.0.1:1", size=10))
    crashed._stop.set()  # simulate a crash: the keep-alive thread stops, no revoke
    reader = EtcdMetadata(url)
    try:
        assert reader.lookup("tmp-seg") is not None
        deadline = time.monotonic() + 10
        while reader.lookup("tmp-seg") is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert reader.lookup("tmp-seg") is None
    finally:
        reader.close()


def test_unreachable_etcd_is_a_clear_error() -> None:
    meta = EtcdMetadata("etcd://127.0.0.1:1", timeout_s=0.5)
    with pytest.raises(TransferError, match="etcd get failed"):
        meta.lookup("x")
