"""End to end (real master and node processes): a put whose write frame is stalled on the way
to the node past its deadline is revoked; another put then gets the same space, and when the
stalled bytes finally reach the node they are refused, so the other value stays intact."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from msgspec.structs import replace
from store_procs import store_cluster

from yuebing.core.errors import StoreError
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import (
    EmbeddedMetadata,
    SegmentDescriptor,
    TransferConfig,
    TransferEngine,
)

SIZE = 1 << 20
DELAY_S = 1.2


class StallingProxy:
    """Forwards TCP connections to ``target``. After a connection's first chunk from the client
    (the lane handshake), client bytes are held until ``DELAY_S`` after the next one arrived,
    then forwarded as they come; ``replies`` collects what the target sent back."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"
        self.socks: list[socket.socket] = []
        self.replies = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.socks += [client, upstream]
            threading.Thread(target=self._stall, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._reply, args=(upstream, client), daemon=True).start()

    @staticmethod
    def _stall(src: socket.socket, dst: socket.socket) -> None:
        release = 0.0
        with contextlib.suppress(OSError):
            dst.sendall(src.recv(1 << 20))  # the handshake
            while data := src.recv(1 << 20):
                release = release or time.monotonic() + DELAY_S
                time.sleep(max(0.0, release - time.monotonic()))
                dst.sendall(data)

    def _reply(self, src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                self.replies += data
                dst.sendall(data)

    def close(self) -> None:
        self.srv.close()
        for s in self.socks:
            s.close()


class Redirect(EmbeddedMetadata):
    """Segment directory of the stalled client: ``name`` resolves to ``desc`` (the node's
    segment, reached through the proxy)."""

    def __init__(self, name: str, desc: SegmentDescriptor) -> None:
        super().__init__()
        self._name, self._desc = name, desc

    def lookup(self, name: str) -> SegmentDescriptor | None:
        return self._desc if name == self._name else super().lookup(name)


@pytest.fixture()
def cluster() -> Iterator[tuple[str, str]]:
    with store_cluster("fenced", dram=str(SIZE), node_args=("--tx-write-grace-s", "0.2"),
                       master_args=("--write-grace-s", "0.2", "--fence-s", "0.3",
                                    "--high-watermark", "1.0")) as (mst, nd):
        yield mst.info["address"], nd.info["dram"]


@pytest.mark.slow
def test_stalled_write_cannot_corrupt_the_value_that_reuses_its_space(cluster) -> None:
    addr, seg = cluster
    with StoreClient(ClientConfig(master=addr, direct=False)) as other:
        desc = other.engine.describe(seg)
        proxy = StallingProxy(desc.address)
        meta = Redirect(seg, replace(desc, address=proxy.address, shm_path="", host_id="elsewhere"))
        stalled_engine = TransferEngine(TransferConfig(transports=("tcp",)), metadata=meta)
        stalled = StoreClient(ClientConfig(master=addr, transfer_timeout_s=0.3, put_retries=0,
                                           direct=False), engine=stalled_engine)
        t0 = time.monotonic()
        with pytest.raises(StoreError, match="revoked"):
            stalled.put("late", np.full(SIZE, 0xEE, np.uint8))
        value = np.arange(SIZE, dtype=np.uint32).astype(np.uint8)
        while True:  # the segment holds one value: the revoked put's space must be reused
            try:
                other.put("fresh", value)
                break
            except StoreError as e:
                assert "NO_SPACE" in str(e) or "free bytes" in str(e), e
                assert time.monotonic() - t0 < DELAY_S, "the fence should end before the stall"
                time.sleep(0.05)
        time.sleep(max(0.0, t0 + DELAY_S + 0.8 - time.monotonic()))  # the stalled frame landed
        assert b"expired" in proxy.replies  # the stalled frame reached the node, was refused
        assert other.get("fresh") == value.tobytes()  # checksum-verified: not overwritten
        stalled.close()
        stalled_engine.close()
        proxy.close()
