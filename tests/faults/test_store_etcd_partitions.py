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
  begins (in host p, cut from etcd too; the cut lasts until it is ready, if that takes
  longer than ``CUT_S``) joins once healed, a decode started after the heal too.

The load's prompts all stay in the prefill's own prefix cache, so it never loads from the
pool; `test_cold_prefill_across_store_partition` makes it: a prefill with an empty cache,
started while the store is cut from its host, serves the stored prompts by computing them
(its loads fail), and after the heal loads them from the pool.

Checked (`faultcheck.fault_under_load`): every request of the load succeeded with the
reference outputs within its deadline, a fresh request is served again, the levels (KV blocks,
reservations, the store's objects and bytes) return to baseline. Slow; skipped where network
namespaces cannot be made (not root, no ``ip``) or etcd is not installed.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from faultcheck import LEVELS_WAIT_S, Baseline, Fault, fault_under_load
from faultcheck import _accounted as accounted
from faultrig import Outcome, Rig, get_json, one_request, wait_levels
from netns import Hosts

from etcd_util import EtcdServer, find_etcd
from yuebing.instance.connector import KVConnectorConfig

pytestmark = [pytest.mark.slow, pytest.mark.etcd,
              pytest.mark.skipif(find_etcd() is None, reason="etcd binary not installed "
                                 "(scripts/install_test_servers.sh)")]

CUT_S = 10.0
HOST = {"store-master": "m", "store-node": "n"}
"""Where each role runs besides the prefill instances (host p); the others (the Conductor,
the decode instances) run in host 0, etcd in host e."""
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
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("YUEBING_CLUSTER_TOKEN", "partitions-token")  # every role binds beyond lo
            etcd = EtcdServer(host=hosts.ip["e"], prefix=hosts.place("e").prefix).start()
            try:
                rig = Rig(etcd=etcd.url, place=lambda role: hosts.place(
                    "p" if role.startswith("prefill") else HOST.get(role, "0")))
                try:
                    yield State(Baseline(rig), hosts, etcd)
                finally:
                    rig.stop()
            finally:
                etcd.stop()
    finally:
        hosts.close()


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
        time.sleep(max(0.0, end - time.monotonic()))  # the fault lasts until end
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


def _served_on(rig: Rig, name: str, count: int) -> list[tuple[int, float]]:
    """(``cached`` tokens, ``prefix_load`` ms) of every request the Conductor's access log
    shows on prefill instance ``name``, once it shows ``count`` of them (the line is written
    as the response ends)."""
    end = time.monotonic() + 10
    while True:
        out = []
        for line in rig.procs["conductor"].log().splitlines():
            if f" prefill={name} " in line and "prefix_load=" in line:
                out.append((int(line.split(" cached=")[1].split()[0]),
                            float(line.split("prefix_load=")[1].split("ms")[0])))
        if len(out) >= count or time.monotonic() > end:
            return out
        time.sleep(0.1)


@pytest.mark.timeout(600)
def test_cold_prefill_across_store_partition(state: State) -> None:
    """prefill-0 stopped (SIGSTOP: the Conductor drops it), the store cut from the prefill's
    host, a new prefill started there: three of the stored prompts are served correctly and
    in time by computing them (the Conductor plans loads from the pool, which fail); after the
    heal the other three, never prefilled on it, are loaded from the pool (``cached`` > 0:
    no two prompts share a block)."""
    rig, hosts, ref = state.base.rig, state.hosts, state.base.ref
    links = CASES["store-prefill"]
    rig.signal("prefill-0", signal.SIGSTOP)
    new = ""
    try:
        _wait_view(rig, lambda load: "prefill-0" not in load)
        for a, b in links:
            hosts.cut(a, b)
        try:
            new = rig.add_instance("prefill")  # ready with the store out of reach
            _wait_view(rig, lambda load: new in load)
            for i in range(3):
                r = one_request(rig.url, i, 30.0)
                assert r.outcome == Outcome.OK and r.tokens == ref[i], r
        finally:
            for a, b in links:
                hosts.heal(a, b)
        during = _served_on(rig, new, 3)
        time.sleep(KVConnectorConfig.store_retry_s + 1.0)  # a failed call's skipping is over
        for i in range(3, len(ref)):
            r = one_request(rig.url, i, 30.0)
            assert r.outcome == Outcome.OK and r.tokens == ref[i], r
        after = _served_on(rig, new, len(ref))[len(during):]
        print(f"(cached tokens, prefix_load ms) on {new}: during the cut {during}, "
              f"after the heal {after}")
        assert [c for c, _ in during] == [0, 0, 0], during  # computed
        # the first load gives up on the master after load_timeout_s per call (was 15.1 s:
        # the store client's failover budget); the later ones skip the store
        assert max(ms for _, ms in during) < 1000 * (KVConnectorConfig.load_timeout_s + 3.0)
        assert len(after) == 3 and any(c > 0 for c, _ in after), after  # loaded
    finally:
        if new:
            rig.remove_instance(new)
        rig.signal("prefill-0", signal.SIGCONT)
    rig.wait_joined()
    got = wait_levels(rig, state.base.base, LEVELS_WAIT_S)
    assert got == state.base.base, got
    end = time.monotonic() + LEVELS_WAIT_S  # every store byte an object's or a reservation's
    while not accounted(rig, state.base.object_bytes):
        assert time.monotonic() < end, rig.store_usage()
        time.sleep(0.5)


def _wait_view(rig: Rig, ok: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not ok(rig.health()["load"]):
        assert time.monotonic() < end, rig.health()
        time.sleep(0.2)
