"""Network partitions of the store and of etcd (issue 16), under the steady load of
`faultrig.Load`.

Five hosts (`netns.Hosts`): this namespace (host 0: the test's clients, the Conductor and the
decode), and a namespace each for the prefill (host p), the store master (m), the store node
(n) and etcd (e), each pair joined by a link of its own. The cluster depends on etcd as
``yuebing serve --etcd`` makes it (the store master's leader lease, the instances' discovery);
every role binds its host's address, so they share a cluster token. A partition brings the
links named by the case down for ``CUT_S`` seconds, then heals them:

- ``store-prefill``: the store (master and node) from the prefill: its loads and saves
  cannot reach the pool, so it computes what it would have loaded;
- ``node-master``: the store node from the store master only (the instances still reach
  both): the node's heartbeats stop; once healed the node is mounted (again) and the pool
  fills again;
- ``etcd``: etcd from the Conductor and the instances (the store master still reaches it):
  the Conductor serves on with the instances it knows; a prefill instance started as the cut
  begins (in host 0, cut from etcd too; the cut lasts until it is ready, if that takes
  longer than ``CUT_S``) joins once healed, one started after the heal too.

Checked (`faultcheck.fault_under_load`): every request of the load succeeded with the
reference outputs within its deadline, a fresh request is served again, the levels (KV blocks,
reservations, the store's objects and bytes) return to baseline. Slow; skipped where network
namespaces cannot be made (not root, no ``ip``) or etcd is not installed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from faultcheck import Baseline, Fault, fault_under_load
from faultrig import Outcome, Rig, get_json
from netns import Hosts

from etcd_util import EtcdServer, find_etcd

pytestmark = [pytest.mark.slow, pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed "
                                 "(scripts/install_test_servers.sh)")]

CUT_S = 10.0
HOST = {"prefill-0": "p", "store-master": "m", "store-node": "n"}
"""Where each role runs; the others (the Conductor, the decode, instances added later) run in
host 0, etcd in host e."""
CASES: dict[str, tuple[tuple[str, str], ...]] = {
    "store-prefill": (("p", "m"), ("p", "n")),
    "node-master": (("n", "m"),),
    "etcd": (("e", "0"), ("e", "p")),
}


@dataclass
class State:
    base: Baseline
    hosts: Hosts
    etcd: EtcdServer


@pytest.fixture(scope="module")
def state() -> Iterator[State]:
    hosts = Hosts.create(("p", "m", "n", "e"))
    token = os.environ.get("YUEBING_CLUSTER_TOKEN")
    os.environ["YUEBING_CLUSTER_TOKEN"] = "partitions-token"  # every role binds beyond lo
    try:
        etcd = EtcdServer(host=hosts.ip["e"], prefix=hosts.place("e").prefix).start()
        try:
            rig = Rig(etcd=etcd.url, place=lambda role: hosts.place(HOST.get(role, "0")))
            try:
                yield State(Baseline(rig), hosts, etcd)
            finally:
                rig.stop()
        finally:
            etcd.stop()
    finally:
        hosts.close()
        if token is None:
            os.environ.pop("YUEBING_CLUSTER_TOKEN", None)
        else:
            os.environ["YUEBING_CLUSTER_TOKEN"] = token


def _cut(s: State, links: tuple[tuple[str, str], ...], late: list[str] | None) -> Fault:
    """Cut ``links`` for ``CUT_S``. With ``late``, a prefill instance is started as the cut
    begins (its name lands in ``late`` once it is ready), and the cut lasts until it has been
    ready for a second if that takes longer (a process start on a loaded box), so that it
    comes up while etcd is out of reach."""
    starter = threading.Thread(
        target=lambda: late.append(s.base.rig.add_instance("prefill")) if late is not None
        else None, daemon=True)

    def cut() -> None:
        for a, b in links:
            s.hosts.cut(a, b)
        if late is not None:
            starter.start()

    def heal() -> None:
        end = time.monotonic() + CUT_S
        if late is not None:
            starter.join(s.base.rig.timeout_s)
            end = max(end, time.monotonic() + 1.0)
        time.sleep(max(0.0, end - time.monotonic()))
        for a, b in links:
            s.hosts.heal(a, b)
    return Fault(cut, heal)


def _segments(s: State) -> list[tuple[str, str, int]]:
    """The store master's segments: (name, node, state)."""
    return sorted((g["name"], g["node"], g["state"])
                  for g in get_json(s.base.rig.store_admin + "/segments"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_store_etcd_partition_under_load(state: State, case: str) -> None:
    rig = state.base.rig
    late: list[str] | None = [] if case == "etcd" else None
    segments = _segments(state)

    def after() -> None:
        end = time.monotonic() + 30
        while _segments(state) != segments:  # the node is mounted (again)
            assert time.monotonic() < end, (segments, _segments(state))
            time.sleep(0.2)
        if late is None:
            return
        assert late, "an instance started during the cut did not get ready"
        rig.wait_joined()  # it joined once etcd was reachable again
        name = rig.add_instance("decode")  # a registration after the heal
        rig.wait_joined()
        for n in (name, *late):
            rig.remove_instance(n)
        rig.wait_joined()  # the Conductor let go of them

    row = fault_under_load(state.base, case, f"cut{CUT_S:.0f}",
                           _cut(state, CASES[case], late),
                           allowed=frozenset({Outcome.OK}), after=after)
    assert row["during"].get("OK", 0) > 0, row  # served during the cut
