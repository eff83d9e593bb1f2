"""A read that stalls past its read lease never returns another value's bytes (real master and
node processes, checksums OFF so a reused range would go unnoticed): the first replica's node is
SIGSTOPped mid-read; once the lease is over the value is removed and another value is put into
its range on the second replica. The reader must return the right value or a clean error —
without the lease bound it fell back to the second replica after the lease and read the other
value's bytes."""

from __future__ import annotations

import signal
import threading
import time

from store_procs import master, node

from yuebing.core.errors import StoreError
from yuebing.protocol import store as m
from yuebing.store.client.client import StoreClient
from yuebing.store.client.gets import ReadLeaseExpired
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import TransferConfig, TransferEngine

LEASE = 0.4
SIZE = 64 * 1024
V, W = b"v" * SIZE, b"w" * SIZE


def _remove_when_unleased(c: StoreClient, key: str, within_s: float) -> None:
    """Unforced remove, retried while a reader leases ``key``."""
    end = time.monotonic() + within_s
    while True:
        try:
            c.remove(key)
            return
        except StoreRpcError as e:
            if e.code != m.Code.LEASED or time.monotonic() > end:
                raise
            time.sleep(0.02)


def test_stalled_read_never_returns_a_reused_range() -> None:
    mst = master("--lease-ttl-s", str(LEASE))
    addr = mst.info["address"]
    nodes = [node(addr, "4MiB", "--name", "nodeA"), node(addr, "4MiB", "--name", "nodeB")]
    by_seg = {n.info["dram"]: n for n in nodes}
    # TCP only (the same-host shm paths would not stall); a stalled peer's lanes are re-opened
    # with a handshake the batch deadline does not bound: keep it short
    engine = TransferEngine(TransferConfig(metadata="p2p", transports=("tcp",),
                                           connect_timeout_s=0.3))
    reader = StoreClient(ClientConfig(master=addr, checksum=False, direct=False,
                                      transfer_timeout_s=1.5, reserve_ahead=False), engine)
    writer = StoreClient(ClientConfig(master=addr, checksum=False, reserve_ahead=False))
    stopped = None
    try:
        for seg in by_seg:  # the reader connects to both nodes while they run
            writer.put(f"warm/{seg}", b"x", strategy="preferred", preferred=[seg])
            assert reader.get(f"warm/{seg}") == b"x"
        writer.put("v", V, replicas=2)
        reps = writer.rpc.call(m.GetReplicas(key="v")).replicas  # type: ignore[attr-defined]
        first, second = reps[0], reps[1]  # the order every reply lists them in
        stopped = by_seg[first.segment]
        time.sleep(LEASE)  # that lease is over
        stopped.proc.send_signal(signal.SIGSTOP)
        out: dict[str, object] = {}

        def read() -> None:
            try:
                out["value"] = bytes(reader.get("v"))
            except StoreError as e:
                out["error"] = e

        t = threading.Thread(target=read)
        t.start()
        time.sleep(LEASE)  # the read outlasts the lease
        _remove_when_unleased(writer, "v", 5.0)
        writer.put("w", W, strategy="preferred", preferred=[second.segment])
        w = writer.rpc.call(m.GetReplicas(key="w")).replicas  # type: ignore[attr-defined]
        assert w == [second]  # the removed value's range on the second replica, reused
        t.join(10)
        assert not t.is_alive()
        if "value" in out:
            assert out["value"] == V, "read another value's bytes from a reused range"
        else:
            assert isinstance(out["error"], ReadLeaseExpired), out["error"]
    finally:
        if stopped is not None:
            stopped.proc.send_signal(signal.SIGCONT)
        reader.close()
        writer.close()
        engine.close()
        for p in nodes:  # no drain on the way out: kill
            p.kill()
        mst.stop()

