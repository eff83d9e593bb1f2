"""Fault injection under load (issue 16): for each role of a one-host cluster (store master,
store node, prefill, decode, Conductor; `faultrig.Rig`), ``kill -9`` (then the test restarts
the role at its address, as an operator or `yuebing serve`'s supervisor would) or ``SIGSTOP``
for a while then ``SIGCONT``, while `faultrig.Load` sends streamed greedy requests.

After each fault (`faultcheck.fault_under_load`): every request ended within its deadline
(success, an HTTP error status or an SSE error event; a stream cut short only when the
Conductor itself was killed), every successful output equals the reference taken before any
fault, the cluster serves a fresh request again (the recovery time is measured and, with
``$YUEBING_FAULTS_REPORT``, appended to that JSON-lines file for docs/reliability.md), the
reference prompts still give the reference outputs, and the instances' free/reserved KV
blocks, the Conductor's requests in flight and the store's used bytes, objects, pending puts
and reservations are back at their baseline. The fast set stops a process for 4 s; every
role × fault with a 10 s stop is slow.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from faultcheck import SERVED, Baseline, fault_under_load, kill_restart, stop_cont
from faultrig import ROLES, Outcome, Rig

FAST = {("decode-0", "kill"), ("prefill-0", "stop4"), ("conductor", "kill")}
CASES = [pytest.param(role, fault, id=f"{role}-{fault}",
                      marks=() if (role, fault) in FAST else pytest.mark.slow)
         for role in ROLES for fault in ("kill", "stop4", "stop10")
         if not (fault == "stop4" and (role, fault) not in FAST)]


@pytest.fixture(scope="module")
def state() -> Iterator[Baseline]:
    rig = Rig()
    try:
        yield Baseline(rig)
    finally:
        rig.stop()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("role", "fault"), CASES)
def test_fault_under_load(state: Baseline, role: str, fault: str) -> None:
    rig = state.rig
    allowed = SERVED
    if role == "conductor" and fault == "kill":
        allowed |= {Outcome.CONN_ERROR, Outcome.CUT}
    inject = (kill_restart(rig, role) if fault == "kill"
              else stop_cont(rig, role, float(fault.removeprefix("stop"))))
    fault_under_load(state, role, fault, inject, allowed)
