"""`Dispatcher`: one request from its token ids to the tokens relayed back; called by the HTTP
routes with a validated `GenRequest`.

Life cycle: block keys → `RequestInfo` → the request's `ClusterView` → `Policy.decide` (a
`Reject` raises `Rejected`: 429 + Retry-After). Disaggregated when prefill and decode instances
are alive: the request waits for its turn in the prefill's `PrefillGate`, then ``reserve`` on
the decode (retried up to ``reserve_wait_s`` while it has no free KV), then ``submit`` of the
prefill task with its `PrefixPlan` and the `DecodeTarget` (to every stage of a pipeline group,
each with its `StagePlan`; the last stage's first token is relayed, an earlier stage's error
ends it at once); else one coupled ``submit``. The instances' events are relayed as `Delta`s
(decode events that overtake a first token wait).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

import msgspec

from yuebing.conductor.api import GenRequest
from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.delta import Delta
from yuebing.conductor.delta import delta as make_delta
from yuebing.conductor.metrics import ConductorMetrics
from yuebing.conductor.pages import page_keys
from yuebing.conductor.policy import Policy, Reject, RejectReason, RequestInfo, Route
from yuebing.conductor.push import Pusher, token_sink
from yuebing.conductor.stats import RequestStats
from yuebing.conductor.view import STORE_HOLDER
from yuebing.core.ids import BlockHash, InstanceId
from yuebing.instance.client import InstanceClient, InstanceError, InstanceUnavailable
from yuebing.instance.kvkeys import store_block_keys
from yuebing.protocol.instance import (
    ErrorCode,
    EventKind,
    PrefixPlan,
    Reserved,
    Role,
    StagePlan,
    SubmitTask,
    TaskEvent,
    TaskMode,
)

log = logging.getLogger(__name__)


class Rejected(Exception):
    """The request is refused before any work (HTTP 429/503; 400 when never servable)."""

    def __init__(self, reason: str, retry_after_s: float, message: str = "") -> None:
        super().__init__(message or f"request rejected: {reason}")
        self.reason = reason
        self.retry_after_s = retry_after_s


class RequestFailed(Exception):
    """The request failed after routing (an instance error, a dead decode, a timeout)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Retry(Exception):
    """The attempt failed before any token: the request may be re-dispatched (``recompute``:
    without reusing a pipeline group's store prefix, which a stage found missing)."""

    def __init__(self, message: str, recompute: bool = False) -> None:
        super().__init__(message)
        self.recompute = recompute


_Events = AsyncIterator[tuple[TaskEvent, float]]
"""An instance client's `timed_events`: each event with its arrival time."""

class Dispatcher:
    """Routes and relays requests over one `LiveCluster` with one `Policy`.

    Faults: an ERROR from an instance the cluster found dead, or no answer to a call, before
    any token reached the client re-dispatches the request once, as does a stage's
    ``PREFIX_MISSING`` (its range's store objects were evicted after the look: the group
    recomputes the prefix); any other ERROR, or one after
    tokens were sent, raises `RequestFailed`. Every exit other than a finished request (errors,
    the request timeout, a client disconnect) cancels it on every instance involved, in the
    background, freeing their blocks."""

    def __init__(self, cluster: LiveCluster, policy: Policy, metrics: ConductorMetrics,
                 request_timeout_s: float, reserve_wait_s: float = 10.0) -> None:
        self.cluster = cluster
        self.policy = policy
        self.metrics = metrics
        self.request_timeout_s = request_timeout_s
        self.reserve_wait_s = reserve_wait_s

    async def generate(self, req: GenRequest, stats: RequestStats,
                       out: Pusher | None = None) -> AsyncIterator[Delta]:
        """The request's output; raises `Rejected` or `RequestFailed` (see the module doc).
        With ``out`` (a streamed response's `Pusher`) plain token events are written by it
        from the instance client's reader whenever it is ready, not yielded here."""
        deadline = time.monotonic() + self.request_timeout_s
        stats.prompt_tokens = len(req.prompt_ids)
        recompute = False
        pages = functools.cache(lambda size: page_keys(req.prompt_ids, size,
                                                       hash(self.cluster.fingerprint)))
        for attempt in (0, 1):
            rid = stats.request_id if attempt == 0 else f"{stats.request_id}-r{attempt}"
            stats.started_s = time.perf_counter()
            info, route, coupled = self._decide(req, rid, pages)
            stats.decided_s = time.perf_counter()
            try:
                async for delta in self._attempt(req, info, route, coupled, stats, deadline,
                                                 out, pages, recompute):
                    yield delta
                return
            except _Retry as e:
                if attempt == 0 and stats.completion_tokens == 0:
                    log.warning("%s: %s; re-dispatching", stats.request_id, e)
                    stats.redispatched += 1
                    self.metrics.redispatched.inc()
                    recompute = e.recompute
                    continue
                raise RequestFailed("instance_failed", str(e)) from None

    # ------------------------------------------------------------------ decision

    def _decide(self, req: GenRequest, rid: str,
                pages: Callable[[int], Sequence[int]]) -> tuple[RequestInfo, Route, bool]:
        """The request's route (``pages``: its `conductor.pages.page_keys` by page size, computed
        once per request), or `Rejected`."""
        c = self.cluster
        prefills, decodes = c.alive(Role.PREFILL), c.alive(Role.DECODE)
        groups = c.groups() if decodes and req.sampling.n == 1 else []  # groups: one choice
        if req.sampling.n > 1 and decodes and not prefills and not c.alive(Role.COUPLED) \
                and c.groups():
            self.metrics.rejected_requests.labels(RejectReason.UNSERVABLE).inc()
            raise Rejected(RejectReason.UNSERVABLE, math.inf, "n > 1 needs a single prefill "
                           "instance or a coupled one: pipeline groups sample one choice")
        coupled = not ((prefills or groups) and decodes)
        if coupled:
            prefills = decodes = c.alive(Role.COUPLED)
            groups = []
        keys = (store_block_keys(req.prompt_ids, c.store_block_tokens, c.fingerprint)
                if c.fingerprint else [])
        now = time.monotonic()
        # n choices share the prompt's KV; each grows its own output
        info = RequestInfo(rid, now, len(req.prompt_ids), tuple(BlockHash(k) for k in keys),
                           req.sampling.max_tokens * req.sampling.n)
        view = c.view(info, prefills, decodes, now, groups, pages)
        decision = self.policy.decide(info, view)
        if coupled and isinstance(decision, Route) and decision.decode_id != decision.prefill_id:
            mine = tuple(d for d in view.decodes if d.instance_id == decision.prefill_id)
            decision = self.policy.decide(info, replace(view, decodes=mine))
        if isinstance(decision, Reject):
            self.metrics.rejected_requests.labels(decision.reason).inc()
            raise Rejected(decision.reason, decision.retry_after_s,
                           _reject_message(decision))
        return info, decision, coupled

    def _plan(self, route: Route, info: RequestInfo,
              recompute: bool = False) -> tuple[PrefixPlan, int]:
        """The prefill's `PrefixPlan` and how many store blocks it copies to the instance. A
        route on the local prefix is topped up from the store when the store holds a longer
        run of the prompt (loading beats recomputing). ``recompute``: a group reuses no
        prefix (a stage of the first attempt found its objects evicted)."""
        tokens = self.policy.prefix_tokens
        n = info.input_tokens
        src = route.fetch_from
        if route.stages and recompute:
            return PrefixPlan(), 0
        if route.stages:  # every stage loads its range's store objects of the same prefix
            bt = self.cluster.store_block_tokens
            blocks = route.reused_blocks if route.reused_blocks * bt < n else \
                route.reused_blocks - 1  # whole engine blocks, below the prompt's end
            return (PrefixPlan(tokens=blocks * bt, source="store") if blocks > 0
                    else PrefixPlan()), 0
        if src == STORE_HOLDER:
            return PrefixPlan(tokens=tokens(route.reused_blocks, n), source="store"), \
                route.fetch_blocks
        if src is not None:
            peer = self.cluster.members.get(InstanceId(str(src)))
            return PrefixPlan(tokens=tokens(route.reused_blocks, n), source="peer",
                              peer=str(src), peer_address=peer.address if peer else ""), \
                route.fetch_blocks
        stored = self.cluster.index.run_of(STORE_HOLDER, info.block_keys)
        assembled, ranges = self.cluster.assembled_run(info.block_keys)
        if assembled > max(stored, route.reused_blocks):  # a group's range objects
            return PrefixPlan(tokens=tokens(assembled, n), source="store",
                              layer_ranges=ranges), assembled - route.reused_blocks
        if stored > route.reused_blocks:
            return PrefixPlan(tokens=tokens(stored, n), source="store"), \
                stored - route.reused_blocks
        return PrefixPlan(tokens=tokens(route.reused_blocks, n) if route.reused_blocks else 0,
                          source="local"), 0

    # ------------------------------------------------------------------ one attempt

    async def _attempt(self, req: GenRequest, info: RequestInfo, route: Route, coupled: bool,
                       stats: RequestStats, deadline: float, out: Pusher | None,
                       pages: Callable[[int], Sequence[int]],
                       recompute: bool = False) -> AsyncIterator[Delta]:
        c, m = self.cluster, self.metrics
        pres = [c.members[s] for s in route.stages or (route.prefill_id,)]
        pre, dec = pres[-1], c.members[route.decode_id]
        """``pres``: the prefill instance, or a group's stages (the last samples the token)."""
        rid = info.request_id
        plan = self._routed(info, route, coupled, stats, recompute)
        involved: list[Member] = []
        finished = False
        try:
            if coupled:
                involved.append(pre)
                stats.dispatched_s = time.perf_counter()
                await pre.client.submit(SubmitTask(
                    seq=0, request_id=rid, token_ids=req.prompt_ids, sampling=req.sampling,
                    mode=TaskMode.COUPLED, prefix=plan))
            else:
                await self._disaggregated(req, info, route, plan, pres, dec, stats, deadline,
                                          involved)
            m.overhead.observe(stats.dispatch_s)
            if not stats.redispatched:  # a second attempt's phases overlap the first's
                for phase, took in stats.dispatch_phases().items():
                    m.dispatch_phase.labels(phase).observe(took)
            loop = asyncio.get_running_loop()
            watch = [loop.create_task(_watch_stage(s, pre, rid)) for s in pres[:-1]]
            unnoted = None if route.stages else pre.pages
            try:
                async for delta in self._relay(rid, pres, dec, coupled, stats, deadline, out,
                                               req.sampling.n):
                    if unnoted is not None:  # prefilled: its engine has the prompt's pages
                        unnoted.note(pages(unnoted.page_tokens))
                        unnoted = None
                    yield delta
            finally:
                for w in watch:
                    w.cancel()
            finished = True
        except InstanceUnavailable as e:
            raise _Retry(str(e)) from None
        except InstanceError as e:
            if e.code in (ErrorCode.NO_KV, ErrorCode.OVERLOADED):
                reason = "decode_kv_full" if e.code == ErrorCode.NO_KV else "instance_overloaded"
                m.rejected_requests.labels(reason).inc()
                raise Rejected(reason, self.policy.config.min_retry_after_s, str(e)) from None
            raise RequestFailed(e.code.name.lower(), str(e)) from None
        finally:
            for p in pres:
                c.prefill_done(rid, p.id)
            c.decode_done(rid, dec.id)
            if not finished and involved:
                c.spawn(_cancel(involved, rid))

    async def _disaggregated(self, req: GenRequest, info: RequestInfo, route: Route,
                             plan: PrefixPlan, pres: list[Member], dec: Member,
                             stats: RequestStats, deadline: float,
                             involved: list[Member]) -> None:
        """The request's turn at its prefill instance's gate (a group's: at every stage's, in
        layer order, so no two requests wait on each other), the decode's reservation, then
        the PREFILL task to the instance or to every stage (each added to ``involved`` before
        its call, for the cancel on exit)."""
        c, rid = self.cluster, info.request_id
        t0 = time.perf_counter()
        for p in pres:
            await p.gate.acquire(rid, info.input_tokens - plan.tokens,
                                 self.policy.queued(info, route), owner=p.id)
        stats.gate_s += time.perf_counter() - t0
        for p in pres:
            c.admitted(rid, p.id, time.monotonic())
        involved.append(dec)
        t0 = time.perf_counter()
        reserved = await self._reserve(dec, rid, req, deadline)
        stats.reserve_s += time.perf_counter() - t0
        stats.dispatched_s = time.perf_counter()
        for i, p in enumerate(pres):
            involved.append(p)
            await p.client.submit(SubmitTask(
                seq=0, request_id=rid, token_ids=req.prompt_ids, sampling=req.sampling,
                mode=TaskMode.PREFILL, prefix=plan, decode=reserved.target,
                stage=_stage_plan(pres, i, plan.tokens) if route.stages else None))

    def _routed(self, info: RequestInfo, route: Route, coupled: bool,
                stats: RequestStats, recompute: bool = False) -> PrefixPlan:
        """The request's prefix plan; the route recorded in ``stats``, the cluster's own
        accounting and the routing/replication counters."""
        c, m = self.cluster, self.metrics
        pre, dec = route.prefill_id, route.decode_id
        plan, copied = self._plan(route, info, recompute)
        stats.prefill_id, stats.decode_id, stats.prefix_source = str(pre), str(dec), plan.source
        stats.pipelined = bool(route.stages)
        stats.est_ttft_s, stats.est_transfer_s = route.est_ttft_s, route.est_transfer_s
        stats.est_queue_s, stats.est_prefill_s = route.est_queue_s, route.est_prefill_s
        stats.prefill_busy, stats.prefill_factor = route.prefill_busy, route.prefill_factor
        c.routed(info, route, time.monotonic())
        m.routed_requests.labels(pre, "coupled" if coupled else "prefill").inc()
        if not coupled:
            m.routed_requests.labels(dec, "decode").inc()
        if copied:
            m.blocks_replicated.labels(plan.source).inc(copied)
        return plan

    async def _reserve(self, dec: Member, rid: str, req: GenRequest,
                       deadline: float) -> Reserved:
        """Reserve the request's KV on its decode instance; while the instance has no free KV
        (it frees blocks as its requests end), retry for up to ``reserve_wait_s``."""
        give_up = min(deadline, time.monotonic() + self.reserve_wait_s)
        delay = 0.02
        while True:
            try:
                return await dec.client.reserve(
                    rid, req.prompt_ids, req.sampling,
                    timeout_s=max(1.0, deadline - time.monotonic()))
            except InstanceError as e:
                left = give_up - time.monotonic()
                if e.code != ErrorCode.NO_KV or left <= 0:
                    raise
            await asyncio.sleep(min(delay, left))
            delay = min(0.25, delay * 2)

    async def _relay(self, rid: str, pres: list[Member], dec: Member, coupled: bool,
                     stats: RequestStats, deadline: float, out: Pusher | None,
                     n: int = 1) -> AsyncIterator[Delta]:
        """The prefill's first token (of each of the ``n`` choices), then the decode's stream
        until its FINISH (coupled: one stream). Events
        are read straight from the clients' per-request queues (no task per event); the
        prefill's own end of stream (its breakdown) is drained by a background task. One
        timer per request (not one per event) ends the stream being read at the deadline, and
        a prefill lost before its hand-off ends the decode's stream, both with a marker."""
        loop = asyncio.get_running_loop()
        pre = pres[-1]
        reading = [pre]
        timer = loop.call_at(loop.time() + (deadline - time.monotonic()),
                             lambda: reading[0].client.interrupt(rid, _TIMED_OUT))
        pre_events = pre.client.timed_events(rid)
        drain: asyncio.Task[bool] | None = None
        diverted: InstanceClient | None = None
        try:
            firsts = await self._first_events(pre_events, rid, pres, dec, stats, n)
            stats.cached_tokens = firsts[0][0].cached_tokens
            for p in pres:
                self.cluster.prefill_done(rid, p.id)
            deltas = [make_delta(ev, stats, received) for ev, received in firsts]
            last = any(d.last for d in deltas)
            if not coupled and not last:
                # the decode's stream is the one read next: the timer ends it from here on,
                # also while the first token is with the client
                if loop.time() >= timer.when():  # it fired into the prefill's stream
                    raise self._timed_out(rid)
                reading[0] = dec
            for delta in deltas:
                yield delta
            if last:
                return
            if coupled:
                events = pre_events
            else:
                events = dec.client.timed_events(rid)
                drain = loop.create_task(_drain(pre_events, stats, rid))
                drain.add_done_callback(lambda t: _lost_prefill(t, dec, rid))
            if out is not None:  # plain tokens from here on: `yuebing.conductor.push`
                diverted = pre.client if coupled else dec.client
                diverted.divert(rid, token_sink(out, stats))
            while True:
                ev, received = await self._next(events, rid)
                if ev is _PREFILL_LOST:
                    raise RequestFailed("prefill_failed", f"instance {pre.id} failed before "
                                        "handing the KV to the decode instance")
                stats.merge(ev.breakdown)
                if ev.kind == EventKind.ERROR:
                    raise _failed(dec, ev)
                delta = make_delta(ev, stats, received)
                if delta.last and drain is not None and not drain.done():
                    await asyncio.wait({drain}, timeout=0.2)  # the prefill's breakdown
                yield delta
                if delta.last:
                    return
        finally:
            timer.cancel()
            if diverted is not None:
                diverted.divert(rid, None)
            if drain is not None:
                drain.cancel()

    async def _first_events(self, events: _Events, rid: str, pres: list[Member], dec: Member,
                            stats: RequestStats, n: int) -> list[tuple[TaskEvent, float]]:
        """The prefill's (a group's last stage's) first event with a token of each of the
        request's ``n`` choices (one prefill samples them all; they arrive together), or its
        end. An ERROR raises `_Retry` when an instance of the request died (re-dispatch), else
        `RequestFailed`."""
        got: list[tuple[TaskEvent, float]] = []
        seen: set[int] = set()
        while True:
            ev, received = await self._next(events, rid)
            stats.merge(ev.breakdown)
            if ev.kind == EventKind.ERROR:
                if not all(m.alive for m in (*pres, dec)):
                    raise _Retry(ev.error or "an instance of the request died")
                if ev.error_code == ErrorCode.PREFIX_MISSING:
                    raise _Retry(ev.error, recompute=True)
                raise _failed(pres[-1], ev)
            if ev.token_ids or ev.finish_reason or ev.kind >= EventKind.FINISH:
                got.append((ev, received))
                if ev.token_ids:
                    seen.add(ev.index)
                if len(seen) >= n or ev.kind >= EventKind.FINISH:
                    return got

    async def _next(self, events: _Events, rid: str) -> tuple[TaskEvent, float]:
        """The next event and when its frame arrived."""
        try:
            ev, arrived = await anext(events)
        except StopAsyncIteration:
            raise RequestFailed("instance_error", f"request {rid}: the event stream ended "
                                "early") from None
        if ev is _TIMED_OUT:
            raise self._timed_out(rid)
        return ev, arrived

    def _timed_out(self, rid: str) -> RequestFailed:
        return RequestFailed("timeout", f"request {rid} ran past {self.request_timeout_s:.0f} s")


_TIMED_OUT = TaskEvent(request_id="", kind=EventKind.ERROR, error="the request timed out")
"""Marker the request's timer puts in the stream being read (`InstanceClient.interrupt`)."""
_PREFILL_LOST = TaskEvent(request_id="", kind=EventKind.ERROR, error="the prefill failed")
"""Marker put in the decode's stream when the prefill fails before handing the KV off."""


def _lost_prefill(drain: asyncio.Task[bool], dec: Member, rid: str) -> None:
    """The prefill's drain ended: when it failed before its FINISH (the hand-off), the decode
    would wait for KV that never comes, so its stream ends with `_PREFILL_LOST`."""
    if not drain.cancelled() and drain.exception() is None and not drain.result():
        dec.client.interrupt(rid, _PREFILL_LOST)


def _stage_plan(stages: list[Member], i: int, reuse: int) -> StagePlan:
    last = i == len(stages) - 1
    return StagePlan(index=i, count=len(stages), prefix_tokens=reuse,
                     next_segment="" if last else stages[i + 1].hello.stage_segment)


async def _watch_stage(stage: Member, last: Member, rid: str) -> None:
    """A group's stage before the last: its ERROR (it failed, or died: the cluster ends its
    streams) ends the request's stream on the last stage at once, which would otherwise wait
    out its transfer timeout for rows that never come."""
    async for ev in stage.client.events(rid):
        if ev.kind == EventKind.ERROR:
            last.client.interrupt(rid, msgspec.structs.replace(
                ev, error=f"pipeline stage {stage.id}: {ev.error}"))
            return
        if ev.kind == EventKind.FINISH:
            return


def _failed(m: Member, ev: TaskEvent) -> RequestFailed:
    code = ev.error_code.name.lower() if ev.error_code else "instance_error"
    return RequestFailed(code, f"instance {m.id}: {ev.error}")


async def _drain(events: _Events, stats: RequestStats, rid: str) -> bool:
    """Read the prefill's events after its first token (its FINISH carries its breakdown);
    True when it handed the KV off (FINISH), False when it failed first."""
    async for ev, _ in events:
        stats.merge(ev.breakdown)
        if ev.kind == EventKind.ERROR:
            log.warning("%s: prefill error after the first token: %s", rid, ev.error)
            return False
        if ev.kind == EventKind.FINISH:
            return True
    return False


async def _cancel(members: list[Member], rid: str) -> None:
    """Cancel on every instance, the last involved first: a prefill acknowledges its cancel
    only once it has stopped writing into the decode's reservation, so the decode's blocks
    are freed after no write can still land in them."""
    for m in reversed(members):
        try:
            await m.client.cancel(rid)
        except (InstanceError, InstanceUnavailable) as e:
            log.debug("cancel of %s on %s: %s", rid, m.id, e)


def _reject_message(r: Reject) -> str:
    if r.reason == RejectReason.NO_INSTANCES:
        return "no prefill/decode (or coupled) instance is available"
    if math.isinf(r.retry_after_s):
        return f"this request cannot be served by this cluster ({r.reason})"
    return (f"the server is overloaded ({r.reason}); retry after "
            f"{math.ceil(r.retry_after_s)} s")
