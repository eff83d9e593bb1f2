"""Master failover through a real etcd: every committed object stays readable."""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np
import pytest
from store_procs import leader_of, master, node, wait_leader

from etcd_util import EtcdServer, find_etcd
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed")]


def test_failover_keeps_committed_objects_readable() -> None:
    with EtcdServer() as etcd, ExitStack() as stack:
        ha = ("--etcd", etcd.url, "--cluster", "ft", "--election-ttl-s", "1",
              "--client-ttl-s", "5")
        m1 = master(*ha)
        stack.callback(m1.kill)
        wait_leader(etcd.url, "ft", m1)  # m1 wins the election before m2 starts
        m2 = master(*ha)
        stack.callback(m2.stop)
        addrs = f"{m1.info['address']},{m2.info['address']}"
        stack.callback(node(addrs, "16MiB", "--name", "ha-node").stop)
        c = stack.enter_context(StoreClient(ClientConfig(master=addrs, failover_s=20.0)))
        rng = np.random.default_rng(3)
        vals = {f"ha/{i}": rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes()
                for i in range(20)}
        for k, v in vals.items():
            c.put(k, v)
        # m1, unless a host that left it unscheduled for a whole 1 s TTL let its lease expire
        # (then m2 leads, and m1 follows it): the one that leads now dies
        leader = leader_of(etcd.url, "ft", [m1, m2])
        survivor = m2 if leader is m1 else m1
        leader.kill()
        for k, v in vals.items():  # served by the survivor once it is elected (within ~2 s)
            assert c.get(k) == v
        assert c.rpc.address == survivor.info["address"]
        c.put("ha/after", b"new")  # allocations after takeover do not clobber old ones
        assert c.get("ha/after") == b"new"
        assert all(c.get(k) == v for k, v in vals.items())
        assert c.stats()["objects"] == 21
