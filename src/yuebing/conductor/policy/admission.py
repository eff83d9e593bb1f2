"""Admission control: accept the planned route or reject at arrival, registered by name.

Called by `Policy.decide` after prefill and decode selection with both plans; an admission
returns ``None`` to accept or a `Reject` (reason, stage ``ARRIVAL``, ``retry_after_s``). A
request that even an idle cluster cannot serve gets ``unservable`` and ``retry_after_s = inf``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from yuebing.conductor.policy.decode import (
    State,
    current_state,
    decode_forecast,
    forecast_decode_load,
    forecast_state,
    plan_on,
)
from yuebing.conductor.policy.registries import ADMISSIONS
from yuebing.conductor.policy.types import (
    ClusterView,
    DecodePlan,
    PrefillPlan,
    Reject,
    RejectReason,
    RejectStage,
    RequestInfo,
)

if TYPE_CHECKING:
    from yuebing.conductor.policy.policy import Policy




def decode_retry_after(pol: Policy, req: RequestInfo, view: ClusterView, from_s: float,
                       threshold: float) -> float:
    """Seconds after ``from_s`` until the forecast decode load is ≤ ``threshold``.

    Probes a doubling grid starting at max(``min_retry_after_s``, 0.25 s) up to twice the
    longest decode duration (returned when no probe is low enough); ``inf`` when even an idle
    instance could not take the request. The probes decay the requests decoding now and never
    hold them (`forecast_state` without ``hold``), whichever forecast refused the request: the
    hold stands for the arrivals that refill ending decodes while overloaded, and a client
    cannot wait those out; the answer is when today's residents leave.
    """
    if _unservable(pol, req, view, threshold):
        return math.inf
    wait = max(pol.config.min_retry_after_s, 0.25)
    horizon = 2.0 * pol.max_decode_duration_s
    while wait < horizon:
        if forecast_decode_load(pol, req, view, from_s + wait) <= threshold:
            return wait
        wait *= 2.0
    return horizon


def _unservable(pol: Policy, req: RequestInfo, view: ClusterView, threshold: float) -> bool:
    need = req.input_tokens + req.expected_output_tokens
    idle_tbt = pol.decode_time(1, req.input_tokens) / pol.config.tbt_slo_s
    return idle_tbt > threshold or all(
        need / d.kv_capacity_tokens > threshold for d in view.decodes)


def _reject(reason: RejectReason, retry_s: float, pol: Policy, plan: PrefillPlan,
            dplan: DecodePlan) -> Reject:
    retry = retry_s if math.isinf(retry_s) else max(pol.config.min_retry_after_s, retry_s)
    return Reject(str(reason), RejectStage.ARRIVAL, retry, plan.ttft_s, dplan.tbt_s)


@ADMISSIONS.register("none")
def admit_all(pol: Policy, req: RequestInfo, view: ClusterView, plan: PrefillPlan,
              dplan: DecodePlan) -> Reject | None:
    """``none``: accept everything (the adapter may still reject later, e.g. at decode)."""
    return None


@ADMISSIONS.register("slo")
def admit_slo(pol: Policy, req: RequestInfo, view: ClusterView, plan: PrefillPlan,
              dplan: DecodePlan) -> Reject | None:
    """``slo`` (paper Algorithm 1): reject when the predicted TTFT exceeds its SLO (retry after
    ``TTFT - SLO``), when no decode instance has KV room, or when the predicted TBT exceeds its SLO
    (retry when the decode forecast says the load is back ≤ 1)."""
    cfg = pol.config
    if plan.ttft_s > cfg.ttft_slo_s:
        return _reject(RejectReason.TTFT_SLO, plan.ttft_s - cfg.ttft_slo_s, pol, plan, dplan)
    if dplan.kv_fits and dplan.tbt_s <= cfg.tbt_slo_s:
        return None
    retry = decode_retry_after(pol, req, view, view.now_s, 1.0)
    if math.isinf(retry):
        return _reject(RejectReason.UNSERVABLE, retry, pol, plan, dplan)
    reason = RejectReason.TBT_SLO if dplan.kv_fits else RejectReason.KV_CAPACITY
    return _reject(reason, retry, pol, plan, dplan)


def running_load(pol: Policy, view: ClusterView, plan: PrefillPlan, state: State) -> float:
    """The load (predicted paper TBT / SLO) of the requests decoding while the new request's
    prefill runs beside them (``state``, without the new request): their step times
    `Policy.prefill_tail`, on the most loaded decode instance (on one host every decode shares
    the prefill's cores). 0 with none decoding. An instance where one request alone would be
    over the threshold under the tail is left out: no admission can protect it, and counting
    it would refuse every prefill while anything decodes there. 0 under a tail of 1 (decode on
    its own cores, as the paper's nodes): the prefill does not stretch their steps, so rejecting
    it protects none of them (the chosen instance's own load is the request's decode load)."""
    batch, ctx, _ = state
    tail = pol.prefill_tail(view, plan.prefill_s)
    if tail == 1.0:
        return 0.0
    slo = pol.config.tbt_slo_s
    worst = 0.0
    for n, tokens in zip(batch, ctx, strict=True):
        alone = pol.decode_time(1, tokens / n) * tail if n > 0 else 0.0
        if n <= 0 or alone > pol.config.early_rejection_threshold * slo:
            continue
        worst = max(worst, pol.decode_time(n, tokens) * tail / slo)
    return worst


def running_retry_after(pol: Policy, view: ClusterView, plan: PrefillPlan, from_s: float,
                        threshold: float) -> float:
    """Seconds after ``from_s`` until the forecast running batches take this prefill within
    ``threshold`` (doubling probes as `decode_retry_after`)."""
    wait = max(pol.config.min_retry_after_s, 0.25)
    horizon = 2.0 * pol.max_decode_duration_s
    while wait < horizon:
        if running_load(pol, view, plan, forecast_state(pol, view, from_s + wait)) <= threshold:
            return wait
        wait *= 2.0
    return horizon


def _overload(pol: Policy, req: RequestInfo, view: ClusterView, plan: PrefillPlan,
              dplan: DecodePlan, decode_load: float, decode_at_s: float,
              state: State) -> Reject | None:
    """Reject on the largest of the prefill load, the request's decode load and the running
    decodes' load under its prefill (`running_load`: admitting work that pushes the requests
    already decoding over their SLO loses more than it gains)."""
    threshold = pol.config.early_rejection_threshold
    prefill_load = plan.ttft_s / pol.config.ttft_slo_s
    running = running_load(pol, view, plan, state)
    if max(prefill_load, decode_load, running) <= threshold:
        return None
    if prefill_load >= max(decode_load, running):
        excess_s = plan.ttft_s - threshold * pol.config.ttft_slo_s
        return _reject(RejectReason.PREFILL_OVERLOAD, excess_s, pol, plan, dplan)
    if running > decode_load:
        retry = running_retry_after(pol, view, plan, view.now_s, threshold)
        return _reject(RejectReason.RUNNING_TBT, retry, pol, plan, dplan)
    retry = decode_retry_after(pol, req, view, decode_at_s, threshold)
    reason = RejectReason.UNSERVABLE if math.isinf(retry) else RejectReason.DECODE_OVERLOAD
    return _reject(reason, retry, pol, plan, dplan)


@ADMISSIONS.register("early_rejection")
def admit_early_rejection(pol: Policy, req: RequestInfo, view: ClusterView, plan: PrefillPlan,
                          dplan: DecodePlan) -> Reject | None:
    """``early_rejection`` (arXiv §7.2): reject when ``max(prefill load, decode load)`` exceeds
    ``early_rejection_threshold``; prefill load = predicted TTFT / TTFT SLO, decode load = the
    chosen decode instance's load now (running and waiting requests); the running requests'
    load under this request's prefill counts too (`running_load`)."""
    state = current_state(view, with_pending=False)
    load = dplan.load
    if view.pending_decodes or pol.config.decode_selector != "least_loaded":
        load = plan_on(pol, req, view, state, dplan.index).load
    return _overload(pol, req, view, plan, dplan, load, view.now_s, state)


@ADMISSIONS.register("predictive_early_rejection")
def admit_predictive(pol: Policy, req: RequestInfo, view: ClusterView, plan: PrefillPlan,
                     dplan: DecodePlan) -> Reject | None:
    """``predictive_early_rejection`` (arXiv §7.4): as ``early_rejection``, but the chosen decode
    instance's load is forecast for when this request would reach decode (now + predicted TTFT,
    `decode_forecast`): routed requests still in prefill count; while the prefill pool has work
    they refill the decodes expected to end by then (the batch no lower than now), else those
    drop out (pair it with the ``forecast`` decode selector); the running requests' load under
    its prefill counts too (`running_load`)."""
    at_s = view.now_s + plan.ttft_s
    state = decode_forecast(pol, view, at_s)
    load = dplan.load if pol.config.decode_selector == "forecast" else \
        plan_on(pol, req, view, state, dplan.index).load
    return _overload(pol, req, view, plan, dplan, load, at_s, state)
