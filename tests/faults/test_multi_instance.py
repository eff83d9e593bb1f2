"""Faults with several instances per role (issue 16): two prefill and two decode instances
(`faultrig.Rig` with ``prefill=2, decode=2``) under the steady load of `faultrig.Load`; one
prefill and one decode get ``kill -9`` at the same moment, and stay down until the end of
the outage (then the test restarts them at their addresses).

Besides `faultcheck.fault_under_load`'s checks (deadlines, reference outputs, recovery,
levels back), the survivors take the load: requests are served while the killed pair is
down; only requests the Conductor had on the dead pair before it noticed fail, so the last
error ends within the heartbeat timeout of the kill (the Conductor drops an instance as soon
as its control connection drops, the heartbeat timeout is the fallback), plus slack; and no
gap after the kill between two successes is longer than that last error plus the client's
retry pause plus the longest successful request of the run, plus slack (each client sends its
next request at once after a success, or 0.2 s after an error, so a longer gap means a
request waited on the dead pair without failing). Both bounds use the test's own
measurements, so a loaded box that slows every request widens them, and a Conductor that
kept routing to the dead pair breaks them. Slow: four instances started, two of them twice,
take a minute on the 2-core test box.
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

RETRY_PAUSE_S = 0.2
"""A client's pause before its next request after an error (`faultrig.Load`)."""

SLACK_S = 2.0
"""Scheduling slack on the loaded 2-core box (threads, processes and HTTP hops)."""


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
        time.sleep(DOWN_S)  # the instances stay down this long
        for v in victims:
            rig.start(v)
        rig.wait_joined()

    row = fault_under_load(state, "prefill-1+decode-0", "kill", Fault(inject, end))
    assert row["during"].get("OK", 0) > 0, row  # the survivors served while the pair was down
    # only the requests on the dead pair before the Conductor dropped it failed
    last_error_s = row["last_error_s"] or 0.0
    assert last_error_s < HEARTBEAT_TIMEOUT_S + SLACK_S, row
    # after them, the next request of a client that saw one succeeded on the survivors
    assert row["max_gap_s"] < last_error_s + RETRY_PAUSE_S + row["max_ok_s"] + SLACK_S, row
