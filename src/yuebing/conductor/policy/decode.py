"""Decode instance selection and the decode-load forecast, called by `Policy.decide`.

A decode instance's *load* for a request is ``max(predicted TBT / TBT SLO, KV after admission /
KV capacity)``: 1.0 means it would sit exactly at the SLO or fill its KV memory. The predicted
TBT is the decode step time with this request added: ``decode(batch + waiting + 1, context +
waiting context + input tokens)``; the request reserves ``input + expected output`` tokens of KV.

Selectors (registered by name): ``least_loaded`` picks the least loaded instance among those
whose predicted TBT holds and whose KV fits, falling back to the least loaded instance whose KV
fits, then to the least loaded overall (admission decides whether to reject); ``random`` is a
stable hash of (seed, request id).

`forecast_decode_load` is the system-level forecast of arXiv §7.4: decode durations follow one
fixed distribution (``PolicyConfig.decode_durations_s``, equally likely values), so a request
decoding now is still running Δ seconds later with the equilibrium residual-life probability
``E[max(0, D - Δ)] / E[D]``, a waiting request or one reaching decode at ``s`` with ``P(D > age)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from yuebing.conductor.policy.prefill import stable_index
from yuebing.conductor.policy.types import ClusterView, RequestInfo
from yuebing.core.registry import Registry

if TYPE_CHECKING:
    from yuebing.conductor.policy.policy import Policy


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """The chosen decode instance with its predicted TBT and load for this request."""

    index: int
    tbt_s: float
    kv_fits: bool
    load: float


DecodeSelector = Callable[["Policy", RequestInfo, ClusterView], DecodePlan]
DECODE_SELECTORS: Registry[DecodeSelector] = Registry("decode selector")


def decode_plan(pol: Policy, req: RequestInfo, view: ClusterView, index: int) -> DecodePlan:
    """TBT, KV fit and load of putting ``req`` on ``view.decodes[index]`` now."""
    d = view.decodes[index]
    tbt = pol.decode_time(d.batch_size + d.waiting_requests + 1,
                          d.context_tokens + d.waiting_context_tokens + req.input_tokens)
    kv_after = d.kv_used_tokens + req.input_tokens + req.expected_output_tokens
    kv_load = kv_after / d.kv_capacity_tokens
    return DecodePlan(index, tbt, kv_after <= d.kv_capacity_tokens,
                      max(tbt / pol.config.tbt_slo_s, kv_load))


@DECODE_SELECTORS.register("least_loaded")
def select_least_loaded(pol: Policy, req: RequestInfo, view: ClusterView) -> DecodePlan:
    slo = pol.config.tbt_slo_s
    n_in = req.input_tokens
    need = n_in + req.expected_output_tokens
    decode_time = pol.decode_time
    best, best_key = 0, (3, 0.0)
    for i, d in enumerate(view.decodes):
        tbt = decode_time(d.batch_size + d.waiting_requests + 1,
                          d.context_tokens + d.waiting_context_tokens + n_in)
        kv_after = d.kv_used_tokens + need
        fits = kv_after <= d.kv_capacity_tokens
        load = tbt / slo
        kv_load = kv_after / d.kv_capacity_tokens
        if kv_load > load:
            load = kv_load
        key = (0 if fits and tbt <= slo else (1 if fits else 2), load)
        if key < best_key:
            best, best_key = i, key
    return decode_plan(pol, req, view, best)


@DECODE_SELECTORS.register("random")
def select_random(pol: Policy, req: RequestInfo, view: ClusterView) -> DecodePlan:
    index = stable_index(pol.config.seed, "decode", req.request_id, len(view.decodes))
    return decode_plan(pol, req, view, index)


def forecast_decode_load(pol: Policy, req: RequestInfo, view: ClusterView, at_s: float) -> float:
    """Lowest load over decode instances for ``req`` joining at ``at_s`` (≥ ``view.now_s``)."""
    dt = max(0.0, at_s - view.now_s)
    s_running = pol.residual_survival(dt)
    s_waiting = pol.survival(dt)
    n_dec = len(view.decodes)
    batch = [0.0] * n_dec
    ctx = [0.0] * n_dec
    kv = [0.0] * n_dec
    for k, d in enumerate(view.decodes):
        running_kv = max(0, d.kv_used_tokens - d.waiting_context_tokens)
        batch[k] = d.batch_size * s_running + d.waiting_requests * s_waiting
        ctx[k] = d.context_tokens * s_running + d.waiting_context_tokens * s_waiting
        kv[k] = running_kv * s_running + (d.kv_used_tokens - running_kv) * s_waiting
    if view.pending_decodes:
        _add_pending(pol, view, at_s, batch, ctx, kv)
    need = req.input_tokens + req.expected_output_tokens
    slo = pol.config.tbt_slo_s
    best = float("inf")
    for k, d in enumerate(view.decodes):
        tbt = pol.decode_time(batch[k] + 1, ctx[k] + req.input_tokens)
        load = max(tbt / slo, (kv[k] + need) / d.kv_capacity_tokens)
        best = min(best, load)
    return best


def _add_pending(pol: Policy, view: ClusterView, at_s: float, batch: list[float],
                 ctx: list[float], kv: list[float]) -> None:
    """Add routed requests that reach decode by ``at_s``, weighted by survival to ``at_s``."""
    index = {d.instance_id: k for k, d in enumerate(view.decodes)}
    share = 1.0 / len(view.decodes)
    for p in view.pending_decodes:
        age = at_s - p.expected_decode_start_s
        if age < 0:
            continue
        w = pol.survival(age)
        if w == 0.0:
            continue
        k = index.get(p.decode_id) if p.decode_id is not None else None
        targets = range(len(batch)) if k is None else (k,)
        if k is None:
            w *= share
        for t in targets:
            batch[t] += w
            ctx[t] += w * p.context_tokens
            kv[t] += w * (p.context_tokens + p.expected_output_tokens)
