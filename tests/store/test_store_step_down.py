"""A store master's leadership through a late or failed lease refresh (a descheduled process, a
slow etcd). The etcd elector keeps a lease that a failed refresh did not lose (real etcd);
a leader that steps down and leads again keeps its standby in sync: two `MasterService`s
serving in threads of this process, with electors the test drives, and a real client. Before,
one failed refresh gave the lease up, and a standby kept a stream the leader no longer fed:
a failover lost what came after."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from etcd_util import etcd_server  # noqa: F401 - fixture
from yuebing.cluster.discovery import Discovery
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig, MasterConfig
from yuebing.store.master.election import Elector, EtcdElector
from yuebing.store.master.service import MasterService


@pytest.mark.etcd
def test_a_failed_lease_refresh_is_retried_not_given_up(etcd_server) -> None:  # noqa: F811
    """One refresh fails (etcd did not answer in time): the elector still leads, and its next
    refresh keeps the same lease and key. Rounds run here, one after another (its thread's
    timing plays no part: a TTL of 10 s is not near)."""
    el = EtcdElector(etcd_server.url, "retry", "tcp://127.0.0.1:1", ttl_s=10)
    try:
        el._step()
        assert el.is_leader
        lease, real = el._lease, el._lease.refresh

        def late() -> int:
            raise TimeoutError("etcd did not answer (test)")

        lease.refresh = late  # type: ignore[method-assign]
        el._step()
        assert el._leader and el._lease is lease and el.is_leader
        lease.refresh = real  # type: ignore[method-assign]
        before = el._lease_ok
        el._step()
        assert el._lease is lease and el._lease_ok > before and el.is_leader
        assert Discovery(etcd_server.url, "retry").store_master() == "tcp://127.0.0.1:1"
    finally:
        el.close()


class Driven(Elector):
    """An elector whose answers the test sets: ``leading`` and the leader's address."""

    def __init__(self) -> None:
        self.leading = False
        self.leader_addr = ""

    def start(self) -> None:
        pass

    @property
    def is_leader(self) -> bool:
        return self.leading

    def leader(self) -> str:
        return self.leader_addr


def until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


@pytest.fixture
def pair() -> Iterator[tuple[MasterService, MasterService]]:
    """Two masters serving in threads; the first leads, the second follows it."""
    cfg = MasterConfig(rpc_address="tcp://127.0.0.1:0", tick_s=0.05)
    svcs = [MasterService(cfg, elector=Driven()) for _ in range(2)]
    a, b = svcs
    a.elector.leading = True  # type: ignore[attr-defined]
    a.elector.leader_addr = b.elector.leader_addr = a.address  # type: ignore[attr-defined]
    threads = [threading.Thread(target=s.serve, daemon=True) for s in svcs]
    for t in threads:
        t.start()
    try:
        yield a, b
    finally:
        for s in svcs:
            s.stop()
        for t in threads:
            t.join(10)


def test_a_leader_that_leads_again_after_stepping_down_keeps_its_standby_in_sync(pair) -> None:
    a, b = pair
    with StoreClient(ClientConfig(master=f"{a.address},{b.address}", failover_s=20.0),
                     heartbeat=False) as c:
        until(lambda: bool(a.hub.standbys), "the standby subscribed")
        assert c.put("before", b"1" * 100) == 1  # held by the master, replicated with its commit
        a.elector.leading = False  # a refresh came late: it steps down, its lease still alive
        until(lambda: not a.leading, "the leader stepped down")
        a.elector.leading = True  # the next refresh came in time: it leads again
        until(lambda: a.leading and bool(a.hub.standbys), "the standby subscribed again")
        assert c.put("after", b"2" * 100) == 1  # answered once the standby has it
        a.stop()  # the leader dies; the standby is elected
        b.elector.leading, b.elector.leader_addr = True, b.address  # type: ignore[attr-defined]
        assert c.get("before") == b"1" * 100
        assert c.get("after") == b"2" * 100  # lost before: the standby was fed no more
        assert c.rpc.address == b.address
