"""The policy's parts by name: prefill selectors, decode selectors and admissions.

The modules that define them (`prefill`, `decode`, `admission`; the package imports each)
register into these; `PolicyConfig` checks names against them and `Policy` looks its parts up.
A prefill selector is called ``(policy, request, view)``, a decode selector ``(policy, request,
view, at_s)`` (``at_s``: when the request is expected to reach decode), an admission
``(policy, request, view, prefill_plan, decode_plan)``.
"""

from __future__ import annotations

from collections.abc import Callable

from yuebing.conductor.policy.types import DecodePlan, PrefillPlan, Reject
from yuebing.core.registry import Registry

PREFILL_SELECTORS: Registry[Callable[..., PrefillPlan]] = Registry("prefill selector")
DECODE_SELECTORS: Registry[Callable[..., DecodePlan]] = Registry("decode selector")
ADMISSIONS: Registry[Callable[..., Reject | None]] = Registry("admission policy")
