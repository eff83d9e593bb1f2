"""Multi-process store tests: real master and node processes, the client in this process."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
from store_procs import Proc, node, store_cluster

from etcd_util import free_port
from yuebing.core.errors import StoreError
from yuebing.protocol import decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import EventKind
from yuebing.store.client.client import StoreClient
from yuebing.store.client.gets import ChecksumError, NotFoundError
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.store.events import KvEventSubscriber
from yuebing.store.wire import parse_address
from yuebing.transfer import OpCode, TransferRequest

TTL = "1.5"
C = m.Code


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, Proc, Proc]]:
    with store_cluster("nodeA", "nodeB", master_args=(
            "--client-ttl-s", TTL, "--events-address", "tcp://127.0.0.1:0",
            "--admin-port", str(free_port()))) as (mst, a, b):
        yield mst, a, b


@pytest.fixture()
def client(cluster) -> Iterator[StoreClient]:
    c = StoreClient(ClientConfig(master=cluster[0].info["address"], heartbeat_s=0.3))
    yield c
    c.remove_all(force=True)
    c.close()


def test_roundtrip_zero_copy_batch_and_queries(cluster, client: StoreClient) -> None:
    rng = np.random.default_rng(1)
    vals = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 4096, 1 << 20)]
    for i, v in enumerate(vals):
        client.put(f"blk/{i}", v, replicas=2)
    for i, v in enumerate(vals):
        assert client.get(f"blk/{i}") == v.tobytes()
    out = np.zeros(1 << 20, dtype=np.uint8)
    assert client.get_into("blk/2", out) == 1 << 20 and np.array_equal(out, vals[2])
    codes = client.batch_put([f"b/{i}" for i in range(8)], [bytes([i]) * 1000 for i in range(8)])
    assert codes == [0] * 8
    bufs = [bytearray(1000) for _ in range(9)]
    assert client.batch_get_into([f"b/{i}" for i in range(9)], bufs) == [1000] * 8 + [-1]
    assert bufs[7] == bytes([7]) * 1000
    assert client.batch_get(["b/1", "nope"]) == [bytes([1]) * 1000, None]
    assert client.prefix_match(["blk/0", "blk/1", "x", "blk/2"]) == 2
    assert client.batch_exists(["blk/0", "x"]) == [True, False]
    with pytest.raises(NotFoundError):
        client.get("x")
    assert client.remove_prefix("b/", force=True).n == 8
    assert client.exists("b/0") is False


def test_malformed_rpc_rejected_master_keeps_serving(cluster, client: StoreClient) -> None:
    host, port = parse_address(cluster[0].info["address"])
    s = socket.create_connection((host, port), timeout=5)
    for payload in (b"\x93garbage", msgspec.msgpack.encode({"type": "store.put_start"}),
                    msgspec.msgpack.encode({"type": "store.exists", "key": 5}),
                    encode(m.Exists(key="k", v=99))):
        s.sendall(struct.pack("<IQ", len(payload), 7) + payload)
        length, rid = struct.unpack("<IQ", s.recv(12))
        reply = decode(s.recv(length))
        assert rid == 7 and isinstance(reply, m.Err) and reply.code == m.Code.BAD_REQUEST
    s.sendall(struct.pack("<IQ", 0xFFFFFFFF, 1))  # absurd frame length: connection dropped
    assert s.recv(12) == b""
    client.put("still", b"serving")
    assert client.get("still") == b"serving"


def test_checksum_mismatch_detected(cluster, client: StoreClient) -> None:
    client.put("sum", b"A" * (64 << 10))  # over --inline-max-bytes: its bytes are on the node
    rep = client.rpc.call(m.GetReplicas(key="sum")).replicas[0]
    client.engine.transfer([TransferRequest(OpCode.WRITE, b"B", rep.segment, rep.offset + 100)])
    with pytest.raises(ChecksumError, match="checksum mismatch reading 'sum'"):
        client.get("sum")


def test_events_and_admin(cluster, client: StoreClient) -> None:
    import json
    import urllib.request

    sub = KvEventSubscriber(cluster[0].info["events"])
    end = time.monotonic() + 5
    while not sub.poll(0.05):  # PUB/SUB joined once a probe's events arrive
        assert time.monotonic() < end, "no KV event reached the subscriber"
        client.put("ev/probe", b"p", preferred=[], strategy="random")
        client.remove("ev/probe")
    client.put("ev/1", b"x" * 10, preferred=[], strategy="random")
    client.remove("ev/1")
    client.put("ev/1", b"y" * 10, preferred=[], strategy="random")
    events = []
    end = time.monotonic() + 5
    while len(events) < 3 and time.monotonic() < end:
        events += [(k, key, h) for b in sub.poll(1.0)
                   for k, key, h in zip(b.kinds, b.keys, b.holders, strict=True)
                   if key != "ev/probe"]
    assert [(k, key) for k, key, _ in events] == [
        (EventKind.STORED, "ev/1"), (EventKind.REMOVED, "ev/1"), (EventKind.STORED, "ev/1")]
    assert events[0][2][0].endswith(("nodeA.dram", "nodeB.dram")) and sub.gaps == 0
    sub.close()
    base = f"http://127.0.0.1:{cluster[0].info['admin']}"
    health = json.load(urllib.request.urlopen(base + "/health"))
    assert health["ok"] and health["leader"]
    assert json.load(urllib.request.urlopen(base + "/keys?prefix=ev/")) == ["ev/1"]
    segs = json.load(urllib.request.urlopen(base + "/segments"))
    assert sorted(s["name"].split("/")[-1] for s in segs) == ["nodeA.dram", "nodeB.dram"]
    metrics = urllib.request.urlopen(base + "/metrics").read().decode()
    assert "yuebing_store_objects" in metrics and "yuebing_store_segment_used_bytes" in metrics


def test_client_death_drops_its_replicas_only(cluster, client: StoreClient) -> None:
    c = node(cluster[0].info["address"], "4MiB", "--name", "nodeC")
    seg_c, seg_a = c.info["dram"], cluster[1].info["dram"]
    client.put("on/c", b"c" * 100, strategy="preferred", preferred=[seg_c])
    client.put("on/a", b"a" * 100, strategy="preferred", preferred=[seg_a])
    client.put("on/both", b"b" * 100, replicas=2, strategy="preferred", preferred=[seg_c, seg_a])
    c.kill()
    time.sleep(float(TTL) + 0.6)  # past the node's TTL: the master drops it
    assert client.batch_exists(["on/c", "on/a", "on/both"]) == [False, True, True]
    assert client.get("on/a") == b"a" * 100 and client.get("on/both") == b"b" * 100


def test_storage_node_killed_mid_put_retried_elsewhere_or_leaves_nothing(cluster, client) -> None:
    d = node(cluster[0].info["address"], "4MiB", "--name", "nodeD")
    e = node(cluster[0].info["address"], "4MiB", "--name", "nodeE")
    seg_d, seg_e = d.info["dram"], e.info["dram"]
    d.kill()
    e.kill()  # the master still believes in D and E (until their TTL): puts get placed there
    client.put("moved", b"m" * 100_000, strategy="preferred", preferred=[seg_d])
    reps = client.rpc.call(m.GetReplicas(key="moved")).replicas
    assert [r.segment for r in reps] != [seg_d] and client.get("moved") == b"m" * 100_000
    no_retry = StoreClient(ClientConfig(master=cluster[0].info["address"], put_retries=0))
    try:
        with pytest.raises(StoreError, match="put revoked"):
            no_retry.put("half", b"h" * 100_000, strategy="preferred", preferred=[seg_e])
    finally:
        no_retry.close()
    assert client.exists("half") is False and client.direct._maps.get(seg_e) is None
    with pytest.raises(NotFoundError):
        client.get("half")
    # D and E are suspected now: a batch spreading over the emptiest segments avoids them
    assert client.batch_put([f"sp/{i}" for i in range(6)], [b"s" * 5000] * 6) == [0] * 6
    assert {r.segment for r in client.rpc.call(m.BatchGetReplicas(keys=[f"sp/{i}" for i in range(6)]))
            .replicas for r in r} <= {cluster[1].info["dram"], cluster[2].info["dram"]}
    st = client.stats()
    assert st["pending"] == 0 and st["suspects"] == 2


def test_same_host_direct_path_skips_the_engine(cluster) -> None:
    addr, seg_a = cluster[0].info["address"], cluster[1].info["dram"]
    big = np.arange(1 << 20, dtype=np.uint8)  # at the default small-copy limit or above it
    with StoreClient(ClientConfig(master=addr)) as c, \
            StoreClient(ClientConfig(master=addr, direct=False)) as e:
        c.put("d/big", big, strategy="preferred", preferred=[seg_a])
        assert c.batch_put(["d/s1", "d/s2"], [b"1" * 100, b"2" * 5000], strategy="preferred",
                           preferred=[seg_a]) == [0, 0]
        e.put("d/e", b"e" * 5000, strategy="preferred", preferred=[seg_a])
        par = [np.full(3 << 20, i + 1, dtype=np.uint8) for i in range(2)]  # split if measured so
        assert c.batch_put(["d/p1", "d/p2"], par, strategy="preferred", preferred=[seg_a]) == [0, 0]
        assert e.batch_get(["d/p1", "d/p2"]) == [p.tobytes() for p in par]
        back = [np.zeros(3 << 20, dtype=np.uint8) for _ in range(2)]
        assert c.batch_get_into(["d/p2", "d/p1"], back) == [3 << 20] * 2
        assert np.array_equal(back[0], par[1]) and np.array_equal(back[1], par[0])
        # each path reads what the other wrote
        assert e.batch_get(["d/big", "d/s1", "d/s2"]) == [big.tobytes(), b"1" * 100, b"2" * 5000]
        out = np.zeros(1 << 20, dtype=np.uint8)
        assert c.get_into("d/big", out) == 1 << 20 and np.array_equal(out, big)
        assert c.get("d/e") == b"e" * 5000
        assert list(c.direct._maps) == [seg_a] and c.engine.stats()["endpoints"] == 0
        assert e.engine.stats()["endpoints"] == 1
        c.remove_prefix("d/", force=True)


def test_ssd_offload_and_promotion(tmp_path) -> None:
    with (store_cluster("nodeS", dram="1MiB", node_args=("--ssd", f"{tmp_path}:4MiB"),
                        master_args=("--high-watermark", "0.5", "--evict-ratio", "0.2",
                                     "--lease-ttl-s", "0.2")) as (mst, _),
          StoreClient(ClientConfig(master=mst.info["address"])) as c):
        vals = {f"s/{i}": bytes([i]) * 200_000 for i in range(4)}
        for k, v in vals.items():
            c.put(k, v)
        end = time.monotonic() + 10
        while c.stats()["offloads"] < 2 and time.monotonic() < end:
            time.sleep(0.05)
        st = c.stats()
        assert st["offloads"] >= 2 and st["ssd_used"] >= 400_000 and st["dram_used"] <= 600_000
        for k, v in vals.items():  # SSD-only values are promoted back on hit
            assert c.get(k) == v
        assert c.stats()["promotions"] >= 2


def test_async_client(cluster) -> None:
    import asyncio

    from yuebing.store.client.client import AsyncStoreClient

    async def main() -> None:
        async with AsyncStoreClient(ClientConfig(master=cluster[0].info["address"])) as c:
            keys = [f"as/{i}" for i in range(6)]
            assert await c.batch_put(keys, [bytes([i]) * 5000 for i in range(6)]) == [0] * 6
            got = await asyncio.gather(*(c.get(k) for k in keys))
            assert got == [bytes([i]) * 5000 for i in range(6)]
            buf = np.zeros(5000, dtype=np.uint8)
            assert await c.get_into("as/3", buf) == 5000 and int(buf[0]) == 3
            assert await c.batch_get_into(["as/1", "zz"], [bytearray(5000), bytearray(1)]) == [5000, -1]
            assert await c.batch_exists(["as/0", "zz"]) == [True, False]
            assert await c.prefix_match(keys + ["zz"]) == 6
            with pytest.raises(NotFoundError):
                await c.get("zz")
            vals = [b"p" * 4096, b"q" * 70000]
            assert await c.batch_put_from(["as/p", "as/q"], vals) == [0, 0]
            assert await c.batch_get(["as/q", "zz", "as/p", "as/2"]) == [
                vals[1], None, vals[0], bytes([2]) * 5000]
            await c.put("as/pin", b"n" * 100)  # never read: no read lease holds it
            assert await c.pin(["as/pin", "zz"], hard=True) == [int(C.OK), int(C.NOT_FOUND)]
            with pytest.raises(StoreRpcError, match="PINNED"):
                await c.remove("as/pin")
            assert await c.pin(["as/pin"], unpin=True) == [int(C.OK)]
            st = await c.stats()
            assert st["objects"] >= 9 and st["puts"] >= 9 and st["pending"] == 0
            assert (await c.remove_prefix("as/", force=True)).n == 9

    asyncio.run(main())
