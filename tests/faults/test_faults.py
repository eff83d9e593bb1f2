"""Fault injection under load (issue 16): for each role of a one-host cluster (store master,
store node, prefill, decode, Conductor; `faultrig.Rig`), ``kill -9`` (then the test restarts
the role at its address, as an operator or `yuebing serve`'s supervisor would) or ``SIGSTOP``
for a while then ``SIGCONT``, while `faultrig.Load` sends streamed greedy requests.

After each fault: every request ended within its deadline (success, an HTTP error status or
an SSE error event; a stream cut short only when the Conductor itself was killed), every
successful output equals the reference taken before any fault, the cluster serves a fresh
request again (the recovery time is measured and, with ``$YUEBING_FAULTS_REPORT``, appended
to that JSON-lines file for docs/reliability.md), the reference prompts still give the
reference outputs, and the instances' free/reserved KV blocks, the Conductor's requests in
flight and the store's used bytes, objects, pending puts and reservations are back at their
baseline. The fast set stops a process for 4 s; every role × fault with a 10 s stop is slow.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from faultrig import (
    ROLES,
    Load,
    Outcome,
    Rig,
    first_success,
    reference,
    wait_levels,
)

RECOVERY_LIMIT_S = 90.0
"""A generous bound on a recovery (restart included) on a loaded 2-core box; the measured
times are reported, not asserted tighter (timing asserts are not allowed in tests)."""

FAST = {("decode-0", "kill"), ("prefill-0", "stop4"), ("conductor", "kill")}
CASES = [pytest.param(role, fault, id=f"{role}-{fault}",
                      marks=() if (role, fault) in FAST else pytest.mark.slow)
         for role in ROLES for fault in ("kill", "stop4", "stop10")
         if not (fault == "stop4" and (role, fault) not in FAST)]


class State:
    def __init__(self) -> None:
        self.rig = Rig()
        self.ref = reference(self.rig.url)
        assert reference(self.rig.url) == self.ref  # a warm cluster gives the same outputs
        time.sleep(1.0)
        self.base = self.rig.levels()
        self.used = self.rig.used_bytes()


@pytest.fixture(scope="module")
def state() -> Iterator[State]:
    s = State()
    try:
        yield s
    finally:
        s.rig.stop()


def _inject(rig: Rig, role: str, fault: str) -> tuple[float, float]:
    """Apply ``fault`` to ``role``; returns (seconds the role was down or stopped, the time
    from which recovery is measured)."""
    t0 = time.monotonic()
    if fault == "kill":
        rig.kill(role)
        rig.start(role)  # the operator's restart, at once; ready when it returns
        if role in ("conductor", "prefill-0", "decode-0"):
            rig.wait_joined()
        return time.monotonic() - t0, t0
    stop_s = float(fault.removeprefix("stop"))
    rig.signal(role, signal.SIGSTOP)
    time.sleep(stop_s)
    rig.signal(role, signal.SIGCONT)
    return stop_s, time.monotonic()


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("role", "fault"), CASES)
def test_fault_under_load(state: State, role: str, fault: str) -> None:
    rig = state.rig
    load = Load(rig.url)
    time.sleep(2.0)
    down_s, since = _inject(rig, role, fault)
    recovery_s = first_success(rig.url, since, RECOVERY_LIMIT_S)
    time.sleep(2.0)
    results = load.stop()
    outcomes = Counter(r.outcome.name for r in results)
    allowed = {Outcome.OK, Outcome.ERROR_STATUS, Outcome.ERROR_EVENT}
    if role == "conductor" and fault == "kill":
        allowed |= {Outcome.CONN_ERROR, Outcome.CUT}
    bad = [r for r in results if r.outcome not in allowed]
    assert not bad, (outcomes, bad[:5], rig.logs())
    wrong = [r for r in results if r.outcome == Outcome.OK and r.tokens != state.ref[r.prompt]]
    assert not wrong, wrong[:3]
    assert outcomes["OK"] > 0, outcomes
    assert reference(rig.url) == state.ref  # served correctly after the fault
    levels = wait_levels(rig, state.base, 60.0)
    _report(role, fault, down_s, recovery_s, outcomes, levels == state.base)
    assert levels == state.base, {k: (v, levels.get(k)) for k, v in state.base.items()
                                  if levels.get(k) != v}
    assert rig.used_bytes() <= state.used  # the same objects, no leaked allocation


def _report(role: str, fault: str, down_s: float, recovery_s: float, outcomes: Counter[str],
            levels_back: bool) -> None:
    path = os.environ.get("YUEBING_FAULTS_REPORT")
    if not path:
        return
    row: dict[str, Any] = {"role": role, "fault": fault, "down_s": round(down_s, 2),
                           "recovery_s": round(recovery_s, 2), "outcomes": dict(outcomes),
                           "levels_back": levels_back}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
