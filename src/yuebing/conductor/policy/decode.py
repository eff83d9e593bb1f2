"""Decode instance selection and the decode-load forecast, called by `Policy.decide`.

A decode instance's *load* for a request is ``max(predicted TBT / TBT SLO, KV after admission /
KV capacity)``, the predicted TBT being ``decode(batch + 1, context + input tokens)``, times
the learned tail while the prefill pool is busy (`Policy.tbt`). Each selector (registered by
name) counts batch, context and KV its way, then picks the least loaded instance whose TBT holds
and whose KV fits (else whose KV fits, else the least loaded; ties to the first listed).
`forecast_state` is arXiv §7.4's system-level forecast, `decode_forecast` the state admission
judges with it. `duration_quantiles` turns durations (the simulator's predicted, the live
Conductor's observed) into the forecast's distribution.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from yuebing.conductor.policy.prefill import stable_index
from yuebing.conductor.policy.registries import DECODE_SELECTORS
from yuebing.conductor.policy.types import ClusterView, DecodePlan, RequestInfo

if TYPE_CHECKING:
    from yuebing.conductor.policy.policy import Policy


def duration_quantiles(durations: Sequence[float], k: int) -> tuple[float, ...]:
    """``k`` equally likely decode durations standing for ``durations``: their quantiles at
    the midpoints of ``k`` equal-probability bins (linear interpolation, as numpy's default;
    each at least 1 ms)."""
    if not durations or k < 1:
        raise ValueError("duration_quantiles needs at least one duration and k >= 1")
    vals = sorted(durations)
    top = len(vals) - 1
    out = []
    for i in range(k):
        h = (i + 0.5) / k * top
        lo = math.floor(h)
        hi = min(lo + 1, top)
        out.append(max(vals[lo] + (h - lo) * (vals[hi] - vals[lo]), 1e-3))
    return tuple(out)


State = tuple[list[float], list[float], list[float]]
"""Per decode instance: (batch, context tokens, KV tokens) before this request joins."""


def current_state(view: ClusterView, with_pending: bool = True) -> State:
    """Running + waiting (+ routed-and-still-in-prefill at full weight, ``with_pending``)."""
    batch = [float(d.batch_size + d.waiting_requests) for d in view.decodes]
    ctx = [float(d.context_tokens + d.waiting_context_tokens) for d in view.decodes]
    kv = [float(d.kv_used_tokens) for d in view.decodes]
    if with_pending and view.pending_decodes:
        _add_pending(view, None, None, batch, ctx, kv)
    return batch, ctx, kv


def forecast_state(pol: Policy, view: ClusterView, at_s: float, hold: bool = False) -> State:
    """Expected state at ``at_s`` (≥ ``view.now_s``) under the decode-duration distribution.

    Decode durations follow one fixed distribution (``PolicyConfig.decode_durations_s``, equally
    likely values), so a request decoding now still decodes Δ seconds later with the equilibrium
    residual-life probability ``E[max(0, D - Δ)] / E[D]``, and a waiting request, or a routed one
    reaching decode at ``s``, with ``P(D > age)``; routed requests reaching decode after ``at_s``
    are not counted. With ``hold`` an instance whose forecast batch is below its running and
    waiting requests now keeps its state of now (batch, context and KV together): the routed
    requests refill the slots of the decodes that end first, and only those beyond them add to
    the batch (see `decode_forecast`)."""
    dt = max(0.0, at_s - view.now_s)
    s_running = pol.residual_survival(dt)
    s_waiting = pol.survival(dt)
    batch, ctx, kv = [], [], []
    for d in view.decodes:
        running_kv = max(0, d.kv_used_tokens - d.waiting_context_tokens)
        batch.append(d.batch_size * s_running + d.waiting_requests * s_waiting)
        ctx.append(d.context_tokens * s_running + d.waiting_context_tokens * s_waiting)
        kv.append(running_kv * s_running + (d.kv_used_tokens - running_kv) * s_waiting)
    if view.pending_decodes:
        _add_pending(view, pol, at_s, batch, ctx, kv)
    if hold:
        now_batch, now_ctx, now_kv = current_state(view, with_pending=False)
        for i, held in enumerate(now_batch):
            if batch[i] < held:
                batch[i], ctx[i], kv[i] = held, now_ctx[i], now_kv[i]
    return batch, ctx, kv


def decode_forecast(pol: Policy, view: ClusterView, at_s: float) -> State:
    """The state a request reaching decode at ``at_s`` meets: what the ``forecast`` selector and
    ``predictive_early_rejection`` judge. Its paper TBT is set by the most loaded tenth of its
    whole decode, not by the instant it joins, and the requests arriving after it join during
    that decode. While the prefill pool has work (overload, where admission acts) they at least
    replace the decodes that end before ``at_s``, so the batch is held at no less than now
    (`forecast_state` ``hold``). Decaying it instead made the forecast lighter the longer the
    prefill queue: more admitted while overloaded, and the learned tail inflated for the calm
    after. The routed requests still in prefill are those replacements, so they add to the
    batch only beyond the decodes forecast to end; holding the batch and adding them too
    counted the same slots twice, and refused requests that met their SLO. Without
    ``PolicyConfig.forecast_hold`` (the paper report's overload runs) it is arXiv §7.4's
    `forecast_state`, decayed whatever the prefill pool holds."""
    return forecast_state(pol, view, at_s,
                          hold=pol.config.forecast_hold and pol.prefill_busy(view))


def _add_pending(view: ClusterView, pol: Policy | None, at_s: float | None, batch: list[float],
                 ctx: list[float], kv: list[float]) -> None:
    """Add routed requests still in prefill: at full weight (``pol`` None), or weighted by the
    probability that they reached decode by ``at_s`` and still decode then."""
    index = {d.instance_id: k for k, d in enumerate(view.decodes)}
    spread_w = spread_ctx = spread_kv = 0.0
    survival = pol.survival if pol is not None else None
    horizon = at_s if at_s is not None else 0.0
    for p in view.pending_decodes:
        w = 1.0
        if survival is not None:
            age = horizon - p.expected_decode_start_s
            if age < 0:
                continue
            w = survival(age)
            if w == 0.0:
                continue
        k = index.get(p.decode_id) if p.decode_id is not None else None
        if k is None:
            spread_w += w
            spread_ctx += w * p.context_tokens
            spread_kv += w * (p.context_tokens + p.expected_output_tokens)
        else:
            batch[k] += w
            ctx[k] += w * p.context_tokens
            kv[k] += w * (p.context_tokens + p.expected_output_tokens)
    if spread_w:
        share = 1.0 / len(batch)
        for t in range(len(batch)):
            batch[t] += spread_w * share
            ctx[t] += spread_ctx * share
            kv[t] += spread_kv * share


def plan_on(pol: Policy, req: RequestInfo, view: ClusterView, state: State,
            index: int) -> DecodePlan:
    """TBT, KV fit and load of ``req`` joining instance ``index`` in ``state``."""
    batch, ctx, kv = state
    cap = view.decodes[index].kv_capacity_tokens
    step = pol.decode_time(batch[index] + 1, ctx[index] + req.input_tokens)
    tbt = pol.tbt(step, pol.prefill_busy(view))
    kv_after = kv[index] + req.input_tokens + req.expected_output_tokens
    return DecodePlan(index, tbt, kv_after <= cap, max(tbt / pol.config.tbt_slo_s, kv_after / cap),
                      step)


def least_loaded_in(pol: Policy, req: RequestInfo, view: ClusterView, state: State) -> DecodePlan:
    """The tiered least-loaded choice (see the module docstring) in ``state``."""
    batch, ctx, kv = state
    slo = pol.config.tbt_slo_s
    n_in = req.input_tokens
    need = n_in + req.expected_output_tokens
    decode_time, tbt_of, busy = pol.decode_time, pol.tbt, pol.prefill_busy(view)
    best, best_key = 0, (3, 0.0)
    for i, d in enumerate(view.decodes):
        tbt = tbt_of(decode_time(batch[i] + 1, ctx[i] + n_in), busy)
        kv_after = kv[i] + need
        fits = kv_after <= d.kv_capacity_tokens
        load = tbt / slo
        kv_load = kv_after / d.kv_capacity_tokens
        if kv_load > load:
            load = kv_load
        key = (0 if fits and tbt <= slo else (1 if fits else 2), load)
        if key < best_key:
            best, best_key = i, key
    return plan_on(pol, req, view, state, best)


@DECODE_SELECTORS.register("least_loaded")
def select_least_loaded(pol: Policy, req: RequestInfo, view: ClusterView,
                        at_s: float) -> DecodePlan:
    """``least_loaded``: the state now — running batch, requests waiting to join, and requests
    routed there still in prefill (``view.pending_decodes``: counting them keeps a burst of
    arrivals from herding onto one instance)."""
    return least_loaded_in(pol, req, view, current_state(view))


@DECODE_SELECTORS.register("forecast")
def select_forecast(pol: Policy, req: RequestInfo, view: ClusterView, at_s: float) -> DecodePlan:
    """``forecast``: the state forecast for the moment this request reaches decode (now + its
    estimated TTFT, `decode_forecast`); pair it with ``predictive_early_rejection``."""
    return least_loaded_in(pol, req, view, decode_forecast(pol, view, at_s))


@DECODE_SELECTORS.register("random")
def select_random(pol: Policy, req: RequestInfo, view: ClusterView, at_s: float) -> DecodePlan:
    """``random``: a stable hash of (seed, request id)."""
    index = stable_index(pol.config.seed, "decode", req.request_id, len(view.decodes))
    return plan_on(pol, req, view, current_state(view), index)


def forecast_decode_load(pol: Policy, req: RequestInfo, view: ClusterView, at_s: float) -> float:
    """Lowest forecast load over decode instances for ``req`` joining at ``at_s``."""
    state = forecast_state(pol, view, at_s)
    return min(plan_on(pol, req, view, state, k).load for k in range(len(view.decodes)))
