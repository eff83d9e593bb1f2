"""One fault under load, and what is checked after it (issue 16; docs/reliability.md).

`Baseline` takes a `faultrig.Rig`'s reference outputs and levels before any fault.
`fault_under_load` runs `faultrig.Load` against the rig, applies one fault (a callable that
returns once the fault is over: the role restarted and ready, continued, or the partition
healed) while a probe measures the time until a fresh request succeeds, and checks: every
request ended within its deadline as one of the ``allowed`` outcomes, every success returned
the reference tokens, the reference prompts give them again afterwards, and the levels (per
instance free/reserved KV blocks and running requests, the Conductor's requests in flight,
the store's objects, pending puts, and its used bytes all belonging to objects or live
reservations) are back at their baseline. With ``$YUEBING_FAULTS_REPORT`` each case appends
one JSON line (outcomes, times) to that file. The fault modules (``test_faults.py``,
``test_etcd_faults.py``, ``test_partitions.py``, ``test_store_etcd_partitions.py``,
``test_multi_instance.py``) share it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from faultrig import Load, Outcome, Result, Rig, first_success, reference, wait_levels

RECOVERY_LIMIT_S = 90.0
"""A generous bound on a recovery (restart included) on a loaded 2-core box; the measured
times are reported, not asserted tighter (timing asserts are not allowed in tests)."""

LEVELS_WAIT_S = 60.0
"""How long the levels may take to return to baseline, the reference prompts being served
meanwhile (a store block lost in the fault is saved again once the prefill's knowledge that
it was stored, `KVConnectorConfig.known_ttl_s` = 10 s, expired)."""

SERVED = frozenset({Outcome.OK, Outcome.ERROR_STATUS, Outcome.ERROR_EVENT})
"""The outcomes a fault may cause: a success, or a clear error (an HTTP error status with an
OpenAI error body, or an SSE error event then [DONE])."""


def at_rest(rig: Rig, timeout_s: float = 30.0) -> dict[str, Any]:
    """The levels once nothing runs (no request in flight or running, no pending put) and two
    readings 0.25 s apart agree: the saves of the last requests have landed."""
    end = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while True:
        got = rig.levels()
        idle = got["inflight"] == 0 and not got.get("store.pending") and not any(
            v for k, v in got.items() if k.endswith(".running"))
        if (idle and got == last) or time.monotonic() > end:
            return got
        last = got
        time.sleep(0.25)


class Baseline:
    """The rig, the reference outputs (taken twice: a warm cluster gives the same), the
    levels at rest and the store's bytes per object."""

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.ref = reference(rig.url)
        assert reference(rig.url) == self.ref
        self.base = at_rest(rig)
        used, objects, reservations = rig.store_accounting()
        assert objects > 0
        self.object_bytes = used / (objects + reservations)


@dataclass(frozen=True)
class Fault:
    """``inject`` applies it at once; ``end`` returns once it is over (the role restarted
    and ready, continued, or the partition healed)."""

    inject: Callable[[], None]
    end: Callable[[], None]


def kill_restart(rig: Rig, role: str) -> Fault:
    """``kill -9`` then restart at once at the same address (as an operator would)."""
    def restart() -> None:
        rig.start(role)  # ready when it returns
        if role == "conductor" or role in rig.instances:
            rig.wait_joined()
    return Fault(lambda: rig.kill(role), restart)


def stop_cont(rig: Rig, role: str, seconds: float) -> Fault:
    """``SIGSTOP``, ``seconds``, ``SIGCONT`` (a hung process)."""
    def cont() -> None:
        time.sleep(seconds)  # the fault lasts this long
        rig.signal(role, signal.SIGCONT)
    return Fault(lambda: rig.signal(role, signal.SIGSTOP), cont)


def measure(rig: Rig, fault: Fault) -> tuple[float, float, float]:
    """Apply ``fault``. Returns (when it began, on `time.monotonic`; seconds until it was
    over; seconds from its start until a fresh request succeeded, probed from that moment, so
    a fault the cluster serves through counts ~0)."""
    t0 = time.monotonic()
    served: list[float] = []
    probe = threading.Thread(target=lambda: served.append(
        first_success(rig.url, t0, RECOVERY_LIMIT_S)), daemon=True)
    fault.inject()
    probe.start()
    fault.end()
    back_s = time.monotonic() - t0
    probe.join(RECOVERY_LIMIT_S + 15)
    assert served, f"not served again within {RECOVERY_LIMIT_S}s of the fault"
    return t0, back_s, served[0]


def fault_under_load(state: Baseline, role: str, name: str, fault: Fault,
                     allowed: frozenset[Outcome] = SERVED, workers: int = 3,
                     after: Callable[[], None] | None = None,
                     deadline_s: float = 30.0) -> dict[str, Any]:
    """The whole case (see the module's docstring; each request of the load has ``deadline_s``
    to end); ``after`` runs once the load stopped and
    before the levels are compared. Returns the report row (``during``: the outcomes of the
    requests that began and ended while the fault lasted; ``max_gap_s``, ``max_ok_s``,
    ``first_error_s``, ``last_error_s``: `_gaps`; ``errors``: the most frequent error details)."""
    rig = state.rig
    load = Load(rig.url, workers, deadline_s)
    time.sleep(2.0)  # the load runs before the fault
    t0, down_s, recovery_s = measure(rig, fault)
    time.sleep(2.0)  # and after it
    results = load.stop()
    outcomes = Counter(r.outcome.name for r in results)
    during = Counter(r.outcome.name for r in results if t0 <= r.start and r.end <= t0 + down_s)
    bad = [r for r in results if r.outcome not in allowed]
    assert not bad, (outcomes, bad[:5], rig.logs())
    wrong = [r for r in results if r.outcome == Outcome.OK and r.tokens != state.ref[r.prompt]]
    assert not wrong, wrong[:3]
    assert outcomes["OK"] > 0, outcomes
    if after is not None:
        after()
    end = time.monotonic() + LEVELS_WAIT_S
    while True:  # the reference prompts, again and again: served correctly after the fault,
        assert reference(rig.url) == state.ref  # and store blocks lost in it are saved again
        levels = wait_levels(rig, state.base, 3.0)
        accounted = _accounted(rig, state.object_bytes)
        if (levels == state.base and accounted) or time.monotonic() > end:
            break
    row = report(role, name, down_s, recovery_s, outcomes, levels == state.base and accounted,
                 during=dict(during), **_gaps(results, t0),
                 errors=dict(Counter(r.detail[:120] for r in results
                                     if r.outcome != Outcome.OK).most_common(4)))
    assert levels == state.base, {k: (v, levels.get(k)) for k, v in state.base.items()
                                  if levels.get(k) != v}
    assert accounted, rig.store_usage()
    return row


def _gaps(results: list[Result], t0: float) -> dict[str, float | None]:
    """``max_gap_s``: the longest time from the fault (or a success) to the next success;
    ``max_ok_s``: the longest a successful request took; ``first_error_s`` and
    ``last_error_s``: from the fault until the first and the last request ended in an error
    (None without one)."""
    ends = sorted([t0, *(r.end for r in results if r.outcome == Outcome.OK and r.end > t0)])
    oks = [r.end - r.start for r in results if r.outcome == Outcome.OK]
    failed = [r.end - t0 for r in results if r.outcome != Outcome.OK and r.end > t0]
    return {"max_gap_s": round(max(b - a for a, b in zip(ends, ends[1:], strict=False))
                               if len(ends) > 1 else float("inf"), 2),
            "max_ok_s": round(max(oks, default=0.0), 2),
            "first_error_s": round(min(failed), 2) if failed else None,
            "last_error_s": round(max(failed), 2) if failed else None}


def _accounted(rig: Rig, object_bytes: float) -> bool:
    """No store allocation leaked: every byte is an object's or a live reservation's
    (reserve-ahead: each store client holds a bounded few, given back or expiring; a
    revoked one is fenced for a while before it is free)."""
    used, objects, reservations = rig.store_accounting()
    return used == (objects + reservations) * object_bytes


def report(role: str, fault: str, down_s: float, recovery_s: float, outcomes: Counter[str],
           levels_back: bool, **extra: Any) -> dict[str, Any]:
    """The case's row; appended to ``$YUEBING_FAULTS_REPORT`` (JSON lines) when set."""
    row: dict[str, Any] = {"role": role, "fault": fault, "down_s": round(down_s, 2),
                           "recovery_s": round(recovery_s, 2), "outcomes": dict(outcomes),
                           "levels_back": levels_back, **extra}
    path = os.environ.get("YUEBING_FAULTS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row
