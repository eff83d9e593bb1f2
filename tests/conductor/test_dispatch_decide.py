"""`Dispatcher._decide` before the policy: requests this cluster can never serve are refused
with a 400 reason, not sent to retry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from yuebing.conductor.api import GenRequest
from yuebing.conductor.dispatch import Dispatcher, Rejected
from yuebing.conductor.metrics import ConductorMetrics
from yuebing.protocol.instance import Role, Sampling


def _member(name: str) -> SimpleNamespace:
    return SimpleNamespace(id=name, alive=True)


def test_n_above_one_on_a_cluster_of_only_pipeline_groups_is_a_400_not_a_retry() -> None:
    """Groups sample one choice; with no single prefill or coupled instance such a request is
    never servable here: ``unservable`` (HTTP 400), not ``no_instances`` with a Retry-After."""
    alive = {Role.PREFILL: [], Role.DECODE: [_member("d0")], Role.COUPLED: []}
    cluster = SimpleNamespace(alive=lambda role: alive[role],
                              groups=lambda: [("g", [_member("s0"), _member("s1")])])
    d = Dispatcher(cluster, None, ConductorMetrics(), request_timeout_s=1.0)  # type: ignore[arg-type]
    req = GenRequest(chat=False, prompt_ids=[1, 2, 3], sampling=Sampling(n=2), stream=False,
                     include_usage=False)
    with pytest.raises(Rejected) as e:
        d._decide(req, "r1", lambda size: [])
    assert e.value.reason == "unservable" and e.value.retry_after_s == float("inf")
