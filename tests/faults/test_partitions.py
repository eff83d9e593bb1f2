"""Network partitions between test hosts (issue 16), under the steady load of `faultrig.Load`.

Three hosts (`netns.Hosts`): this namespace (host 0: the test's clients, the Conductor, the
store master and node), a namespace for the prefill (host p) and one for the decode (host d),
each pair joined by a link of its own; each instance has its own host identity, so KV moves
over TCP between hosts. Every role binds its host's address, so they share a cluster token.
A partition brings one link down for ``CUT_S`` seconds, then heals it:

- ``prefill-decode``: the KV of every request in flight cannot reach the decode, the control
  plane still sees both;
- ``conductor-decode``: the Conductor (and the store) lose the decode: its reports stop;
- ``conductor-prefill``: the same for the prefill.

Checked (`faultcheck.fault_under_load`): no request outlives its deadline, each ends as a
success or a clear error, outputs equal the reference, a fresh request is served again
(recovery from the cut), the levels return to baseline. Slow (a minute per case on the
2-core box); skipped where network namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from faultcheck import Baseline, Fault, fault_under_load
from faultrig import Rig
from netns import Hosts

pytestmark = pytest.mark.slow

CUT_S = 10.0
HOST = {"prefill-0": "p", "decode-0": "d"}
"""Where each instance runs; the other roles run in host 0."""
CASES = {"prefill-decode": ("p", "d"), "conductor-decode": ("0", "d"),
         "conductor-prefill": ("0", "p")}
LONG_CUT_S = 40.0
"""A partition longer than the instances' ``--transfer-timeout-s`` (30 s)."""


@pytest.fixture(scope="module")
def state() -> Iterator[tuple[Baseline, Hosts]]:
    hosts = Hosts.create(("p", "d"))
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("YUEBING_CLUSTER_TOKEN", "partitions-token")  # every role binds beyond lo
            rig = Rig(place=lambda role: hosts.place(HOST.get(role, "0")))
            try:
                yield Baseline(rig), hosts
            finally:
                rig.stop()
    finally:
        hosts.close()


def _cut(hosts: Hosts, a: str, b: str, seconds: float) -> Fault:
    def heal() -> None:
        time.sleep(seconds)  # the cut lasts this long
        hosts.heal(a, b)
    return Fault(lambda: hosts.cut(a, b), heal)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_partition_under_load(state: tuple[Baseline, Hosts], case: str) -> None:
    base, hosts = state
    fault_under_load(base, case, f"cut{CUT_S:.0f}", _cut(hosts, *CASES[case], CUT_S))


@pytest.mark.timeout(600)
def test_long_prefill_decode_partition_ends_requests(state: tuple[Baseline, Hosts]) -> None:
    """Cut longer than a KV transfer may take: the requests whose KV cannot reach the decode
    end with a clear error once the transfer times out (30 s), within a 45 s deadline."""
    base, hosts = state
    fault_under_load(base, "prefill-decode", f"cut{LONG_CUT_S:.0f}",
                     _cut(hosts, "p", "d", LONG_CUT_S), deadline_s=45.0)
