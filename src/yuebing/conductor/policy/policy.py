"""`Policy`: the single entry point of the Conductor's scheduling decisions.

An adapter (the simulator or the live Conductor) builds one ``Policy(config, predictors)`` at
start-up, then for every arriving request calls `Policy.decide` with a `RequestInfo` and a
`ClusterView`: inputs checked (`InputError`), prefill instance and prefix plan (`prefill`),
decode instance (`decode`), admission (`admission`) → a `Route` or a `Reject`. The policy holds
no mutable state and reads no clock: the same inputs give the same decision. `decide` is the
functional form.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import replace

from yuebing.conductor.policy.config import PolicyConfig
from yuebing.conductor.policy.predictors import Predictors
from yuebing.conductor.policy.queue import PREFILL_QUEUES
from yuebing.conductor.policy.registries import (
    ADMISSIONS,
    DECODE_SELECTORS,
    PREFILL_SELECTORS,
)
from yuebing.conductor.policy.types import (
    ClusterView,
    Decision,
    PrefillPlan,
    PrefillState,
    QueuedPrefill,
    Reject,
    RejectReason,
    RejectStage,
    RequestInfo,
    Route,
)
from yuebing.core.errors import InputError

TOP_SHARE = 0.1
"""The share of a request's token intervals its paper TBT averages (its longest tenth)."""


class Policy:
    """Routing + admission for one `PolicyConfig` and one `Predictors` bundle (immutable)."""

    __slots__ = ("config", "predictors", "max_decode_duration_s", "_prefill", "_decode",
                 "_admission", "_durations", "_mean_duration", "_tail_sums", "prefill_time",
                 "decode_time", "_tp", "cpp_threshold", "queue_order", "tbt_tail")

    def __init__(self, config: PolicyConfig, predictors: Predictors) -> None:
        self.config = config
        self.predictors = predictors
        self._prefill = PREFILL_SELECTORS.get(config.prefill_selector)
        self._decode = DECODE_SELECTORS.get(config.decode_selector)
        self._admission = ADMISSIONS.get(config.admission)
        self.queue_order = PREFILL_QUEUES.get(config.prefill_queue)(
            config.prefill_queue_aging, config.ttft_slo_s)
        """The order of every prefill instance's queue (`yuebing.conductor.policy.queue`)."""
        self.prefill_time = predictors.prefill.predict
        """``prefill_time(new_tokens, cached_tokens)`` seconds (the prefill predictor)."""
        self.decode_time = predictors.decode.predict
        """``decode_time(batch_size, context_tokens)`` seconds per step (the decode predictor)."""
        self.tbt_tail = config.tbt_tail
        self._tp = predictors.transfer.predict
        self.cpp_threshold: float = float(config.cpp_threshold_tokens or math.inf)
        """New-token count above which a prefill runs pipeline-parallel (inf: never)."""
        self._durations = tuple(sorted(config.decode_durations_s))
        self._mean_duration = sum(self._durations) / len(self._durations)
        self.max_decode_duration_s = self._durations[-1]
        # _tail_sums[k] = sum of durations[k:], for E[max(0, D - dt)] in O(log K)
        tails = [0.0] * (len(self._durations) + 1)
        for k in range(len(self._durations) - 1, -1, -1):
            tails[k] = tails[k + 1] + self._durations[k]
        self._tail_sums = tuple(tails)

    # -- helpers the selectors and admission policies call ------------------------------------
    def prefix_tokens(self, blocks: int, input_tokens: int) -> int:
        """Prompt tokens reused from ``blocks`` cached leading blocks: the blocks' tokens (the
        last block may be partial), but never the last prompt token, which is recomputed."""
        return min(blocks * self.config.block_tokens, input_tokens - 1)

    def local_tokens(self, p: PrefillState, input_tokens: int) -> int:
        """Prompt tokens instance ``p`` reuses from its own cache: its leading blocks' and the
        engine's finer pages past them (`PrefillState.local_extra_tokens`), never the last."""
        return min(p.local_prefix_blocks * self.config.block_tokens + p.local_extra_tokens,
                   input_tokens - 1)

    def queue_wait(self, view: ClusterView, index: int, prefill_s: float) -> float:
        """Seconds a new request of ``prefill_s`` waits on ``view.prefills[index]``: the work
        started there, plus the waiting requests the queue order serves before it."""
        p = view.prefills[index]
        if not p.waiting or self.queue_order.arrival_order:
            return p.queue_s
        new = QueuedPrefill("", view.now_s, prefill_s, view.now_s + self.config.ttft_slo_s)
        started = max(0.0, p.queue_s - sum(w.prefill_s for w in p.waiting))
        return started + self.queue_order.ahead_s(p.waiting, new, view.now_s,
                                                  view.now_s + started)

    def queued(self, request: RequestInfo, route: Route) -> QueuedPrefill:
        """``request`` as its prefill instance's queue holds it (both adapters build it here)."""
        return QueuedPrefill(request.request_id, request.arrival_s,
                             route.est_prefill_s + route.est_transfer_s,
                             request.arrival_s + self.config.ttft_slo_s)

    def instance_prefill_time(self, view: ClusterView, index: int, new_tokens: int,
                              cached_tokens: int) -> float:
        """Seconds of a prefill on ``view.prefills[index]``: the predictor's, times the
        instance's `PrefillState.time_factor` (cores lent to it)."""
        return self.prefill_time(new_tokens, cached_tokens) * view.prefills[index].time_factor

    def prefill_estimate(self, view: ClusterView, index: int, new_tokens: int,
                         cached_tokens: int) -> tuple[float, float]:
        """(queue seconds, prefill seconds) of a prefill on ``view.prefills[index]``.

        Above ``cpp_threshold_tokens`` new tokens the prefill is split over a pipeline group of
        k = min(cpp_max_nodes, prefill instances, ceil(new / threshold)) instances: the chosen
        one plus the k-1 least queued others. Each holds 1/k of the layers, plus one chunk of
        pipeline bubble per extra stage: t = t₁ / k · (1 + (k-1) / chunks); it starts when the
        whole group is free. The wait on the chosen instance follows the queue order
        (`queue_wait`); on the others it is their whole queue.
        """
        single = self.instance_prefill_time(view, index, new_tokens, cached_tokens)
        cfg = self.config
        if new_tokens <= self.cpp_threshold or view.groups:  # declared groups: `group_estimate`
            return self.queue_wait(view, index, single), single
        k = min(cfg.cpp_max_nodes, len(view.prefills),
                -(-new_tokens // cfg.cpp_threshold_tokens))
        if k <= 1:
            return self.queue_wait(view, index, single), single
        chunks = -(-new_tokens // cfg.cpp_chunk_tokens)
        t = single / k * (1.0 + (k - 1) / chunks)
        others = sorted(q.queue_s for j, q in enumerate(view.prefills) if j != index)
        return max(self.queue_wait(view, index, t), others[k - 2]), t

    def group_estimate(self, view: ClusterView, index: int, new_tokens: int,
                       cached_tokens: int) -> tuple[float, float]:
        """(queue seconds, prefill seconds) of a prefill on the declared pipeline group
        ``view.groups[index]`` of k stages: it starts when its slowest stage's queue is through;
        each stage computes 1/k of the layers, plus one chunk of pipeline bubble per extra
        stage and one chunk's hand-off of boundary rows per stage boundary:
        t = t₁ / k · (1 + (k-1) / chunks) + (k-1) · hop(chunk)."""
        group = view.groups[index]
        k, cfg = len(group.stages), self.config
        chunk = min(new_tokens, cfg.cpp_chunk_tokens)
        chunks = -(-new_tokens // cfg.cpp_chunk_tokens)
        hop = self.transfer_time(chunk * cfg.cpp_boundary_bytes_per_token, view)
        t = self.prefill_time(new_tokens, cached_tokens) / k * (1.0 + (k - 1) / chunks)
        return group.queue_s, t + (k - 1) * hop

    def tbt(self, step_s: float, busy: bool) -> float:
        """Predicted paper TBT of a request in a step predicted at ``step_s`` (`decode_time`):
        the step, times ``tbt_tail`` while the prefill pool is ``busy``."""
        return step_s * self.tbt_tail if busy else step_s

    def prefill_tail(self, view: ClusterView, prefill_s: float) -> float:
        """The tail the *running* decodes' paper TBT takes while a new prefill of ``prefill_s``
        seconds runs beside them: the whole ``tbt_tail`` while the prefill pool has work anyway,
        else its share of their longest tenth of intervals (a tenth of the mean decode
        duration): ``1 + (tail - 1) · min(1, prefill_s / (0.1 · E[D]))``. An idle pool does not
        stretch them; the admitted request's own prefill does."""
        if self.tbt_tail == 1.0 or self.prefill_busy(view):
            return self.tbt_tail
        share = min(1.0, max(0.0, prefill_s) / (TOP_SHARE * self._mean_duration))
        return 1.0 + (self.tbt_tail - 1.0) * share

    def prefill_busy(self, view: ClusterView) -> bool:
        """Whether the TBT tail applies: a prefill instance has work queued or running, so
        decode steps are likely to meet prefill passes (on shared cores, a stretched step).
        Once admission lets the prefill pool drain, the tail no longer applies: it cannot hold
        the cluster in rejection. (The live Conductor learns the tail from such requests only.)"""
        stages = (s for g in view.groups for s in (*g.stages, *g.twins))
        return any(p.queue_s > 0 for p in (*view.prefills, *stages))

    def transfer_time(self, nbytes: float, view: ClusterView) -> float:
        return self._tp(nbytes, view.link_bandwidth_Bps, view.link_latency_s)

    def survival(self, age_s: float) -> float:
        """P(decode duration > ``age_s``) under the configured distribution."""
        k = bisect.bisect_right(self._durations, age_s)
        return (len(self._durations) - k) / len(self._durations)

    def residual_survival(self, dt_s: float) -> float:
        """P(a request decoding now still decodes ``dt_s`` later): E[max(0, D-dt)] / E[D]."""
        k = bisect.bisect_right(self._durations, dt_s)
        n = len(self._durations)
        return (self._tail_sums[k] - (n - k) * dt_s) / n / self._mean_duration

    # -- the decision ---------------------------------------------------------------------------
    def decide(self, request: RequestInfo, view: ClusterView) -> Decision:
        """Route ``request`` or reject it, given the snapshot ``view``."""
        check_inputs(request, view, self.config.block_tokens)
        view = offered(self, request, view)
        if not (view.prefills or view.groups) or not view.decodes:
            return Reject(str(RejectReason.NO_INSTANCES), RejectStage.ARRIVAL,
                          self.config.min_retry_after_s, None, None)
        plan = self._prefill(self, request, view) if view.prefills else None
        if view.groups:
            plan = choose_group(self, request, view, plan)
        assert plan is not None, "a view with no prefill instance has a group"
        dplan = self._decode(self, request, view, view.now_s + plan.ttft_s)
        rejection = self._admission(self, request, view, plan, dplan)
        if rejection is not None:
            return rejection
        src = view.best_prefix
        group = view.groups[plan.group] if plan.group >= 0 else None
        return Route(
            prefill_id=group.group_id if group else view.prefills[plan.index].instance_id,
            decode_id=view.decodes[dplan.index].instance_id,
            reused_blocks=plan.reused_blocks,
            fetch_from=src.holder if plan.fetch_blocks and src is not None else None,
            fetch_blocks=plan.fetch_blocks,
            est_transfer_s=plan.transfer_s,
            est_queue_s=plan.queue_s,
            est_prefill_s=plan.prefill_s,
            est_ttft_s=plan.ttft_s,
            est_tbt_s=dplan.tbt_s,
            est_step_s=dplan.step_s,
            prefill_busy=self.prefill_busy(view),
            prefill_factor=1.0 if group else view.prefills[plan.index].time_factor,
            stages=tuple(st.instance_id for st in group.stages) if group else (),
        )


def decide(request: RequestInfo, view: ClusterView, config: PolicyConfig,
           predictors: Predictors) -> Decision:
    """Functional form of `Policy.decide` (builds the `Policy`; keep one for hot loops)."""
    return Policy(config, predictors).decide(request, view)


def check_inputs(req: RequestInfo, view: ClusterView, block_tokens: int) -> None:
    """Raise `InputError` naming the field when the request or the view is inconsistent."""
    nkeys = len(req.block_keys)
    if req.input_tokens < 1 or req.expected_output_tokens < 0:
        raise InputError(f"request {req.request_id}: input_tokens must be ≥ 1 and "
                         f"expected_output_tokens ≥ 0, got {req.input_tokens}, "
                         f"{req.expected_output_tokens}")
    if (nkeys - 1) * block_tokens >= req.input_tokens:
        raise InputError(f"request {req.request_id}: {nkeys} block keys of {block_tokens} "
                         f"tokens cannot come from {req.input_tokens} input tokens")
    if not (math.isfinite(view.now_s) and view.link_bandwidth_Bps > 0
            and view.link_latency_s >= 0):
        raise InputError("view: now_s must be finite, link_bandwidth_Bps > 0, "
                         f"link_latency_s ≥ 0; got {view.now_s}, {view.link_bandwidth_Bps}, "
                         f"{view.link_latency_s}")
    if any(not g.stages for g in view.groups):
        raise InputError("view: every pipeline group needs at least one stage")
    for p in (*view.prefills, *(s for g in view.groups for s in g.stages)):
        if not (0 <= p.local_prefix_blocks <= nkeys) or not p.queue_s >= 0 \
                or p.local_extra_tokens < 0:
            raise InputError(f"view: prefill {p.instance_id}: local_prefix_blocks must be in "
                             f"0..{nkeys}, queue_s and local_extra_tokens ≥ 0, got "
                             f"{p.local_prefix_blocks}, {p.queue_s}, {p.local_extra_tokens}")
        if not all(math.isfinite(w.arrival_s + w.deadline_s) and w.prefill_s >= 0
                   and math.isfinite(w.prefill_s) for w in p.waiting):
            raise InputError(f"view: prefill {p.instance_id}: waiting requests need finite "
                             "times and prefill_s ≥ 0")
    for d in view.decodes:
        if d.kv_capacity_tokens <= 0 or min(d.batch_size, d.context_tokens, d.kv_used_tokens,
                                            d.waiting_requests, d.waiting_context_tokens) < 0:
            raise InputError(f"view: decode {d.instance_id}: kv_capacity_tokens must be > 0 "
                             "and counts ≥ 0")
    if view.best_prefix is not None and not 0 <= view.best_prefix.blocks <= nkeys:
        raise InputError(f"view: best_prefix.blocks must be in 0..{nkeys}, "
                         f"got {view.best_prefix.blocks}")


def offered(pol: Policy, req: RequestInfo, view: ClusterView) -> ClusterView:
    """``view`` less the pipeline groups' twins ``req`` may not go to: a twin (a whole-model
    instance on a stage's machine) prefills a prompt alone only while its group is `idle` and
    only when the prompt's uncached suffix on it is at most ``cpp_threshold_tokens`` (longer
    ones are the group's to weigh, `choose_group`). Shorter prompts so use the group's
    machines when it is idle, and never hold it up for long (paper §3.2)."""
    twins = {t.instance_id: g.idle for g in view.groups for t in g.twins}
    if not twins:
        return view
    n = req.input_tokens
    keep = tuple(p for p in view.prefills if p.instance_id not in twins
                 or (twins[p.instance_id]
                     and n - pol.local_tokens(p, n) <= pol.cpp_threshold))
    return view if len(keep) == len(view.prefills) else replace(view, prefills=keep)


def choose_group(pol: Policy, req: RequestInfo, view: ClusterView,
                 single: PrefillPlan | None) -> PrefillPlan | None:
    """The declared pipeline group to prefill ``req`` on instead of ``single`` (the selector's
    plan; None when no single instance is in the view), or ``single``. A group is considered
    when the uncached suffix exceeds ``cpp_threshold_tokens`` (or no single instance exists);
    the lowest estimated TTFT wins, the group's counting its slowest stage's queue and a
    hand-off per extra stage (`Policy.group_estimate`)."""
    best = single
    n = req.input_tokens
    for g, group in enumerate(view.groups):
        cached = pol.prefix_tokens(group.local_prefix_blocks, n)
        if n - cached <= pol.cpp_threshold and single is not None:
            continue
        queue_s, prefill_s = pol.group_estimate(view, g, n - cached, cached)
        plan = PrefillPlan(-1, group.local_prefix_blocks, 0, 0.0, queue_s, prefill_s, g)
        if best is None or plan.ttft_s < best.ttft_s:
            best = plan
    return best
