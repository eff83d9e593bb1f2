"""Master failover through a real etcd: every committed object stays readable."""

from __future__ import annotations

import json
import time
import urllib.request
from contextlib import ExitStack

import numpy as np
import pytest
from store_procs import leader_of, master, node, wait_leader

from etcd_util import EtcdServer, find_etcd, free_port
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed")]


def committed(admin_port: int, prefix: str) -> list[str]:
    """The committed keys under ``prefix`` a master holds (its admin ``/keys``)."""
    url = f"http://127.0.0.1:{admin_port}/keys?prefix={prefix}&limit=1000"
    with urllib.request.urlopen(url, timeout=5) as r:  # noqa: S310
        return sorted(json.loads(r.read()))


def until_holds(admin_port: int, prefix: str, keys: list[str], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while (got := committed(admin_port, prefix)) != sorted(keys):
        assert time.monotonic() < end, got
        time.sleep(0.05)


def test_failover_keeps_committed_objects_readable() -> None:
    with EtcdServer() as etcd, ExitStack() as stack:
        ha = ("--etcd", etcd.url, "--cluster", "ft", "--election-ttl-s", "1",
              "--client-ttl-s", "5")
        a1 = free_port()
        m1 = master(*ha, "--admin-port", str(a1))
        stack.callback(m1.kill)
        wait_leader(etcd.url, "ft", m1)  # m1 wins the election before m2 starts
        a2 = free_port()  # after m1 bound its own
        m2 = master(*ha, "--admin-port", str(a2))
        stack.callback(m2.stop)
        addrs = f"{m1.info['address']},{m2.info['address']}"
        stack.callback(node(addrs, "16MiB", "--name", "ha-node").stop)
        c = stack.enter_context(StoreClient(ClientConfig(master=addrs, failover_s=20.0)))
        c.put("sync/probe", b"p")  # once m2 has it, it follows m1: from then on a put is
        until_holds(a2, "sync/", ["sync/probe"])  # answered only once m2 has it too
        c.remove("sync/probe")
        rng = np.random.default_rng(3)
        vals = {f"ha/{i}": rng.integers(0, 256, 50_000, dtype=np.uint8).tobytes()
                for i in range(20)}
        for k, v in vals.items():
            c.put(k, v)
        # m1, unless a host that left it unscheduled for a whole 1 s TTL let its lease expire:
        # then m2 leads, and m1, its standby since, gets the values from its snapshot first
        leader = leader_of(etcd.url, "ft", [m1, m2])
        survivor = m2 if leader is m1 else m1
        if leader is m2:
            until_holds(a1, "ha/", list(vals))
        leader.kill()
        for k, v in vals.items():  # served by the survivor once it is elected (within ~2 s)
            assert c.get(k) == v
        assert c.rpc.address == survivor.info["address"]
        c.put("ha/after", b"new")  # allocations after takeover do not clobber old ones
        assert c.get("ha/after") == b"new"
        assert all(c.get(k) == v for k, v in vals.items())
        assert c.stats()["objects"] == 21
