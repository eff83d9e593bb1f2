"""yuebing.conductor.policy: the pure Conductor scheduling policies (paper §4, arXiv §7).

Build one `Policy(PolicyConfig(...), Predictors(...))` and call ``policy.decide(request, view)``
(or the functional `decide`) for each arriving request; it returns a `Route` or a `Reject`.
No I/O, no clock reads, no torch: the simulator and the live Conductor share this code.
"""

from yuebing.conductor.policy import admission, prefill  # noqa: F401  (they register their parts)
from yuebing.conductor.policy.config import PolicyConfig
from yuebing.conductor.policy.decode import forecast_decode_load
from yuebing.conductor.policy.policy import Policy, check_inputs, decide
from yuebing.conductor.policy.predictors import (
    BivariatePolynomial,
    DecodePredictor,
    Predictors,
    PrefillPredictor,
    TransferPredictor,
    load_predictors,
    save_predictors,
)
from yuebing.conductor.policy.queue import PREFILL_QUEUES, QueueOrder
from yuebing.conductor.policy.registries import ADMISSIONS, DECODE_SELECTORS, PREFILL_SELECTORS
from yuebing.conductor.policy.types import (
    ClusterView,
    Decision,
    DecodeState,
    PendingDecode,
    PrefillGroup,
    PrefillState,
    PrefixSource,
    QueuedPrefill,
    Reject,
    RejectReason,
    RejectStage,
    RequestInfo,
    Route,
)

__all__ = [
    "ADMISSIONS",
    "DECODE_SELECTORS",
    "PREFILL_QUEUES",
    "PREFILL_SELECTORS",
    "BivariatePolynomial",
    "ClusterView",
    "Decision",
    "DecodePredictor",
    "DecodeState",
    "PendingDecode",
    "Policy",
    "PolicyConfig",
    "Predictors",
    "PrefillPredictor",
    "PrefillGroup",
    "PrefillState",
    "PrefixSource",
    "QueueOrder",
    "QueuedPrefill",
    "Reject",
    "RejectReason",
    "RejectStage",
    "RequestInfo",
    "Route",
    "TransferPredictor",
    "check_inputs",
    "decide",
    "forecast_decode_load",
    "load_predictors",
    "save_predictors",
]
