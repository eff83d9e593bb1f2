"""Master failover through a real etcd: every committed object stays readable."""

from __future__ import annotations

import numpy as np
import pytest
from store_procs import master, node, wait_leader

from etcd_util import EtcdServer, find_etcd
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed")]


def test_failover_keeps_committed_objects_readable() -> None:
    with EtcdServer() as etcd:
        ha = ("--etcd", etcd.url, "--cluster", "ft", "--election-ttl-s", "1",
              "--client-ttl-s", "5")
        m1 = master(*ha)
        wait_leader(etcd.url, "ft", m1)  # m1 wins the election before m2 starts
        m2 = master(*ha)
        addrs = f"{m1.info['address']},{m2.info['address']}"
        n = node(addrs, "16MiB", "--name", "ha-node")
        c = StoreClient(ClientConfig(master=addrs, failover_s=20.0))
        try:
            rng = np.random.default_rng(3)
            vals = {f"ha/{i}": rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes()
                    for i in range(20)}
            for k, v in vals.items():
                c.put(k, v)
            assert c.rpc.address == m1.info["address"]
            m1.kill()
            for k, v in vals.items():  # served by m2 once it is elected (within ~2 s)
                assert c.get(k) == v
            assert c.rpc.address == m2.info["address"]
            c.put("ha/after", b"new")  # allocations after takeover do not clobber old ones
            assert c.get("ha/after") == b"new"
            assert all(c.get(k) == v for k, v in vals.items())
            assert c.stats()["objects"] == 21
        finally:
            c.close()
            n.stop()
            m2.stop()
            m1.kill()
