"""Faults with several instances per role (issue 16): two prefill and two decode instances
(`faultrig.Rig` with ``prefill=2, decode=2``) under the steady load of `faultrig.Load`; one
prefill and one decode get ``kill -9`` at the same moment, and stay down until the end of
the outage (then the test restarts them at their addresses).

Besides `faultcheck.fault_under_load`'s checks (deadlines, reference outputs, recovery,
levels back), the survivors take the load: requests are served while the killed pair is
down, and no gap between two successes (over the whole run) is longer than the Conductor's
heartbeat timeout plus the time a request takes (a request that was on the dead pair fails
once the timeout noticed it; the next goes to the survivors). Slow: four instances started,
two of them twice, take a minute on the 2-core test box.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from faultcheck import Baseline, Fault, fault_under_load
from faultrig import Rig

DOWN_S = 8.0
"""How long the killed pair stays down: longer than the heartbeat timeout (3 s)."""

HEARTBEAT_TIMEOUT_S = 3.0  # the rig's --heartbeat-timeout-s


@pytest.fixture(scope="module")
def state() -> Iterator[Baseline]:
    rig = Rig(prefill=2, decode=2)
    try:
        yield Baseline(rig)
    finally:
        rig.stop()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_one_prefill_and_one_decode(state: Baseline) -> None:
    rig = state.rig
    victims = ("prefill-1", "decode-0")

    def inject() -> None:
        for v in victims:
            rig.kill(v)

    def end() -> None:
        time.sleep(DOWN_S)
        for v in victims:
            rig.start(v)
        rig.wait_joined()

    row = fault_under_load(state, "prefill-1+decode-0", "kill", Fault(inject, end))
    assert row["during"].get("OK", 0) > 0, row  # the survivors served while the pair was down
    # no gap in service beyond the heartbeat timeout (plus one request, plus slack for the
    # loaded box): the survivors took the load
    assert row["max_gap_s"] < HEARTBEAT_TIMEOUT_S + row["max_ok_s"] + 2.0, row
