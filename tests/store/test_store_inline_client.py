"""Both clients against a real master and node (processes on 127.0.0.1): a small put is one
`PutInline` and a get of it one `GetReplicas` whose reply carries the bytes; a batch of small
values is one `BatchPutInline`; a value too large, with replicas or with the client's inline
off goes to the node; a master with inline off answers NOT_INLINE and the client puts it on
a segment, then stops asking for a while; held values survive a failover (etcd)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import pytest
from store_procs import leader_of, master, store_cluster, wait_leader
from test_store_client_parity import recording

from etcd_util import EtcdServer, find_etcd, free_port
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.config import ClientConfig
from yuebing.store.master.objects import HELD_OVERHEAD


def test_small_values_take_one_request_each_way_and_large_ones_go_to_the_node() -> None:
    with store_cluster("inl", master_args=("--inline-max-bytes", "8KiB")) as (mst, _):
        cfg = ClientConfig(master=mst.info["address"])
        with StoreClient(cfg) as c:
            sent = recording(c)
            assert c.put("s/a", b"a" * 4096) == 1
            assert c.get("s/a") == b"a" * 4096
            buf = bytearray(5000)
            assert c.get_into("s/a", buf) == 4096 and buf[:4096] == b"a" * 4096
            assert c.batch_put(["s/b0", "s/b1"], [b"x" * 100, b"y" * 200]) == [0, 0]
            assert c.batch_get(["s/b0", "nope", "s/b1"]) == [b"x" * 100, None, b"y" * 200]
            out = [bytearray(100), bytearray(200)]
            assert c.batch_get_into(["s/b0", "s/b1"], out) == [100, 200]
            assert c.put("s/big", b"z" * 9000) == 1  # over the master's 8 KiB: NOT_INLINE
            assert c.put("s/big2", b"z" * 9000) == 1  # the gate keeps it off the inline path
            assert c.put("s/two", b"t" * 100, replicas=2, best_effort=True) == 1
            assert c.get("s/big") == b"z" * 9000
            assert sent[0] == ["PutInline", "GetReplicas", "GetReplicas", "BatchPutInline",
                               "BatchGetReplicas", "BatchGetReplicas", "PutInline",
                               "PutStart", "PutEnd", "PutStart", "PutEnd", "PutInline",
                               "GetReplicas"]
            stats = c.stats()
            held = stats["inline_used"] - 4 * HELD_OVERHEAD
            assert stats["inline_objects"] == 4 and held == 4096 + 300 + 100
            c.remove("s/a")
            assert c.stats()["inline_used"] == 400 + 3 * HELD_OVERHEAD

        async def aio() -> None:
            async with AsyncStoreClient(cfg) as ac:
                sent = recording(ac)
                assert await ac.put("a/a", b"q" * 1000) == 1
                assert await ac.get("a/a") == b"q" * 1000
                assert await ac.batch_put(["a/b"], [b"r" * 10]) == [0]
                assert await ac.batch_get(["a/b"]) == [b"r" * 10]
                assert sent[0] == ["PutInline", "GetReplicas", "BatchPutInline",
                                   "BatchGetReplicas"]
        asyncio.run(aio())
        off = ClientConfig(master=mst.info["address"], inline_max_bytes=0)
        with StoreClient(off) as c:
            before = c.stats()["inline_objects"]
            c.put("o/a", b"o" * 100)
            assert c.get("o/a") == b"o" * 100 and c.stats()["inline_objects"] == before


def test_a_master_with_inline_off_gets_segment_puts() -> None:
    with (store_cluster("inl0", master_args=("--inline-max-bytes", "0")) as (mst, _),
          StoreClient(ClientConfig(master=mst.info["address"])) as c):
        sent = recording(c)
        c.put("k0", b"a" * 100)
        c.put("k1", b"b" * 100)
        assert c.batch_put(["k2", "k3"], [b"c", b"d"]) == [0, 0]
        assert [c.get(f"k{i}") for i in range(4)] == [b"a" * 100, b"b" * 100, b"c", b"d"]
        assert sent[0][:3] == ["PutInline", "PutStart", "PutEnd"]
        assert sent[0][3:5] == ["PutStart", "PutEnd"]  # the gate: no second refusal
        assert "BatchPutInline" not in sent[0]
        assert c.stats()["inline_objects"] == 0


def test_a_batch_over_the_masters_request_limit_goes_the_normal_way() -> None:
    """A master taking requests of 64 KiB: a 960 KiB batch of small values is answered
    BAD_REQUEST (read whole, not a closed connection), and the client puts them on a node."""
    with (store_cluster("inl64", master_args=("--max-request-bytes", "64KiB",
                                              "--rpc-buffer-bytes", "256KiB")) as (mst, _),
          StoreClient(ClientConfig(master=mst.info["address"])) as c):
        sent = recording(c)
        keys = [f"b/{i}" for i in range(80)]
        values = [bytes([i]) * (12 << 10) for i in range(80)]
        assert c.batch_put(keys, values) == [0] * 80
        assert sent[0][0] == "BatchPutInline" and "BatchPutStart" in sent[0]
        assert c.batch_get(keys) == values
        assert c.put("one", b"1" * 100) == 1  # the gate: the normal way for a while
        assert sent[0][-2:] == ["PutStart", "PutEnd"]


@pytest.mark.etcd
@pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed")
def test_held_values_survive_a_master_failover() -> None:
    """The standby got each held value with its commit entry (the put was answered only once
    it had): killing the leader loses none, and the new leader answers them in its replies."""
    with EtcdServer() as etcd:
        ha = ("--etcd", etcd.url, "--cluster", "inl", "--election-ttl-s", "1")
        admins = [free_port(), free_port()]
        m1 = master(*ha, "--admin-port", str(admins[0]))
        wait_leader(etcd.url, "inl", m1)
        m2 = master(*ha, "--admin-port", str(admins[1]))
        masters = [m1, m2]
        addrs = f"{m1.info['address']},{m2.info['address']}"
        c = StoreClient(ClientConfig(master=addrs, failover_s=20.0))
        try:
            vals = {f"f/{i}": bytes([i]) * (100 + i) for i in range(20)}
            for k, v in vals.items():
                assert c.put(k, v) == 1
            assert c.batch_put(["f/b0", "f/b1"], [b"p", b"q"]) == [0, 0]
            assert c.stats()["inline_objects"] == 22
            # Whichever leads once the standby has them all (a loaded host may move the lease
            # to m2, even while the standby catches up) is killed.
            end = time.monotonic() + 30.0  # the standby may have subscribed late
            while True:
                leader = leader_of(etcd.url, "inl", masters)
                survivor = masters[1 - masters.index(leader)]
                while standby_usage(admins[masters.index(survivor)])["inline_objects"] != 22:
                    assert time.monotonic() < end, "the standby never got the 22 held values"
                    time.sleep(0.05)
                if leader_of(etcd.url, "inl", masters) is leader:
                    break
            leader.kill()
            assert all(c.get(k) == v for k, v in vals.items())  # from the survivor, once elected
            assert c.rpc.address == survivor.info["address"]
            assert c.batch_get(["f/b0", "f/b1"]) == [b"p", b"q"]
            assert c.stats()["inline_used"] == sum(len(v) + HELD_OVERHEAD
                                                   for v in [*vals.values(), b"p", b"q"])
        finally:
            c.close()
            m2.kill()
            m1.kill()


def standby_usage(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/usage", timeout=5) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]
