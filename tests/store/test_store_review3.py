"""Regressions found by a third review: a re-elected leader rebuilds its drain index; a tick's
drain pass keeps every draining replica a reader may hold (two segments draining); a retried
commit with a checksum is recognised without the bounded record; durations must be finite."""

from __future__ import annotations

import pytest
from test_store_drain import done, drain, holders, make, put, tasks
from test_store_reserve import commit, start
from test_store_reserve import make as make_reserve

from yuebing.core.clock import VirtualClock
from yuebing.core.errors import ConfigError
from yuebing.store import messages as m
from yuebing.store.config import ClientConfig, MasterConfig
from yuebing.store.master import eviction, replication, reserve
from yuebing.store.master.core import MasterCore


def test_a_re_elected_leader_does_not_use_its_stale_drain_index() -> None:
    l1 = make(segs=2)
    put(l1, "v", "n0/dram", "n1/dram")
    assert drain(l1, "n0/dram") == 0  # v is spare: a copy on n1
    l2 = MasterCore(l1.cfg, VirtualClock(500.0))  # follows l1, then takes over
    replication.load_snapshot(l2, replication.snapshot(l1))
    replication.take_over(l2)
    l2.handle(m.Heartbeat(client="n0"))
    assert l2.handle(m.Unmount(client="n1", segment="n1/dram")) == m.Ok()  # v only on n0 now
    assert drain(l2, "n0/dram") == 1
    tasks(l2)
    l1.log = None  # l1 re-syncs from l2 as a standby and is elected again
    replication.load_snapshot(l1, replication.snapshot(l2))
    replication.take_over(l1)
    assert holders(l1, "v") == ["n0/dram"]
    assert drain(l1, "n0/dram") == 1  # at risk: the node waits instead of unmounting with v


def test_rolling_drain_keeps_the_replica_a_reader_was_given() -> None:
    core = make(segs=3)
    put(core, "v", "n0/dram", "n1/dram")
    drain(core, "n0/dram")
    core.clock.advance_to(core.clock.now() + 0.5)  # type: ignore[attr-defined]
    got = core.handle(m.GetReplicas(key="v"))
    assert [x.segment for x in got.replicas] == ["n1/dram"]  # type: ignore[union-attr]
    core.clock.advance_to(core.clock.now() + 0.5)  # type: ignore[attr-defined]
    assert drain(core, "n1/dram") == 1  # now both copies drain: migrated to n2
    (owner, t), = tasks(core)
    done(core, owner, t)
    eviction.drain(core)
    assert "n1/dram" in holders(core, "v")  # the reader's replica stays while it may copy
    st = core.handle(m.Drain(client="n1", segment="n1/dram"))
    assert st.leased == 1  # type: ignore[union-attr]


def test_a_retried_commit_with_a_checksum_succeeds_after_the_record_forgot_it() -> None:
    core, _ = make_reserve(dram=16 * 1024 * 1024)
    r = start(core, "a", size=64).reservation
    assert isinstance(commit(core, r.key, "K", size=64, checksum=12345, nxt=False),
                      m.PutCommitted)  # its reply is lost
    for i in range(reserve.RECENT_CLIENTS):  # the bounded record forgets the client
        got = start(core, f"e{i}", client=f"o{i}", size=64).reservation
        commit(core, got.key, f"f{i}", client=f"o{i}", size=64, nxt=False)
    again = commit(core, r.key, "K", size=64, checksum=12345, nxt=False)  # the RPC retry
    assert isinstance(again, m.PutCommitted), again
    other = commit(core, r.key, "K", size=64, checksum=999, nxt=False)  # not the same bytes
    assert isinstance(other, m.Err) and other.code == m.Code.NOT_PENDING


@pytest.mark.parametrize("field", ["put_timeout_s", "client_ttl_s", "lease_ttl_s", "tick_s",
                                   "repl_timeout_s"])
def test_master_durations_must_be_finite(field: str) -> None:
    with pytest.raises(ConfigError, match="finite number of seconds"):
        MasterConfig(**{field: float("inf")})  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["rpc_timeout_s", "heartbeat_s", "transfer_timeout_s"])
def test_client_durations_must_be_finite(field: str) -> None:
    with pytest.raises(ConfigError, match="finite number of seconds"):
        ClientConfig(**{field: float("inf")})  # type: ignore[arg-type]
