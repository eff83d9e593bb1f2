"""`StoreClient.limited`: a master call on a latency path gives up at its limit instead of the
failover budget (the connector's prefix loads); calls outside keep the budget."""

from __future__ import annotations

import math
import time

import pytest

from silent_master import silent_master
from yuebing.core.errors import StoreError
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig


def test_a_limited_call_gives_up_at_its_limit_and_the_others_keep_the_failover_budget() -> None:
    with silent_master() as sm:
        cfg = ClientConfig(master=sm.address, rpc_timeout_s=0.4, failover_s=1.0)
        with StoreClient(cfg, heartbeat=False) as c:
            t0 = time.monotonic()
            with pytest.raises(StoreError, match="the caller's deadline spent"), c.limited(0.25):
                c.prefix_match(["k/0"])
            took = time.monotonic() - t0
            assert 0.2 <= took < 0.25 + 0.4, took  # one try, cut to the limit
            assert sm.received > 0  # the request reached the master, which never answered
            assert c.rpc.call_limit_s == math.inf
            with c.limited(5.0):
                with c.limited(0.2):
                    assert c.rpc.call_limit_s == 0.2
                with c.limited(9.0):  # the shorter limit holds
                    assert c.rpc.call_limit_s == 5.0
                assert c.rpc.call_limit_s == 5.0
            t0 = time.monotonic()
            with pytest.raises(StoreError, match="failover budget spent"):
                c.exists("k/0")
            took = time.monotonic() - t0
            assert 1.0 <= took < 1.0 + 0.4 + 1.0, took  # tries of 0.4 s until 1 s had passed
