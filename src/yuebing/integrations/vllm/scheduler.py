"""`SchedulerSide`: the half of `YuebingConnector` that runs in vLLM's scheduler (EngineCore).

vLLM asks how many prompt tokens the store can give beyond its own prefix cache (`matched`: the
prompt's `KvLayout.store_keys`, one ``prefix_match`` on the store master), then, once blocks are
allocated, how many to load (`allocated`); each step `build` turns the scheduled requests into
the worker's `LoadJob`s, `SaveJob`s and, for a layer-wise hand-off (`plan.StreamParams`),
`StreamJob`s; `finished` forgets the request. Loads are synchronous (inside the step's
forward), so ``get_num_new_matched_tokens`` answers ``(n, False)``. A store that does not
answer within ``load_timeout_s`` counts as holding nothing (the prefix is computed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.plan import (
    RECV_KEY,
    SEND_KEY,
    LoadJob,
    RequestPlan,
    SaveJob,
    StreamParams,
)
from yuebing.integrations.vllm.stream import StreamJob

log = logging.getLogger(__name__)

Lookup = Callable[[Sequence[str]], int]
"""Store keys → how many leading ones the store holds."""


class StoreLookup:
    """`Lookup` on a store client: ``prefix_match`` bounded by ``timeout_s``; any failure is
    logged and counts as a miss."""

    def __init__(self, client: Any, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s

    def __call__(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        try:
            with self.client.limited(self.timeout_s):
                return int(self.client.prefix_match(list(keys)))
        except Exception as e:  # noqa: BLE001 - a store in trouble is a miss, never an error
            log.warning("yuebing store lookup failed (%s); computing the prefix", e)
            return 0

    def close(self) -> None:
        self.client.close()


@dataclass
class StepJobs:
    """One step's work for the worker half."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    sends: list[StreamJob] = field(default_factory=list)
    recvs: list[StreamJob] = field(default_factory=list)
    unsent: list[str] = field(default_factory=list)
    """Requests that ended before their stream to the decode did (the worker forgets it)."""


class SchedulerSide:
    """Per-request `RequestPlan`s and the jobs of each step."""

    def __init__(self, layout: KvLayout, lookup: Lookup, load: bool = True,
                 save: bool = True) -> None:
        self.layout = layout
        self.lookup = lookup
        self.load = load
        self.save = save
        self.plans: dict[str, RequestPlan] = {}
        self.lookups = 0
        self.hit_tokens = 0
        self.unsent: list[str] = []

    def _plan(self, req_id: str, prompt: Sequence[int]) -> RequestPlan:
        plan = self.plans.get(req_id)
        if plan is None:
            plan = RequestPlan(req_id, self.layout.store_keys(prompt), len(prompt), self.layout)
            self.plans[req_id] = plan
        return plan

    def matched(self, req_id: str, prompt: Sequence[int], num_computed: int,
                params: Mapping[str, Any] | None = None) -> int:
        """Tokens the store (or, with ``yuebing_recv`` in ``params``, the decode's receive
        pool) can give beyond vLLM's ``num_computed`` (0 when loads are off)."""
        plan = self._plan(req_id, prompt)
        try:
            plan.send = StreamParams.parse(params, SEND_KEY)
            plan.recv = StreamParams.parse(params, RECV_KEY)
        except ValueError as e:
            log.warning("request %s: %s; no layer-wise hand-off", req_id, e)
            plan.send = plan.recv = None
        if plan.recv is not None:
            n = plan.recv_tokens(num_computed)
            log.info("yuebing layer-wise receive: request %s, %d tokens beyond %d", req_id, n,
                     num_computed)
            return n
        if not self.load or not plan.keys:
            return 0
        self.lookups += 1
        n = plan.matched_tokens(self.lookup(plan.keys), num_computed)
        if n:
            log.info("yuebing store hit: request %s, %d tokens beyond %d", req_id, n,
                     num_computed)
        return n

    def allocated(self, req_id: str, prompt: Sequence[int], block_ids: list[int],
                  num_external: int) -> None:
        """vLLM allocated the request's blocks; ``num_external`` tokens after the hit `matched`
        was told of are to be loaded."""
        plan = self._plan(req_id, prompt)
        plan.allocated(block_ids, num_external)
        self.hit_tokens += num_external

    def build(self, out: Any) -> StepJobs:
        """The jobs of the step vLLM scheduled (``out``: its ``SchedulerOutput``)."""
        jobs = StepJobs(unsent=self.unsent)
        self.unsent = []
        for new in out.scheduled_new_reqs:
            plan = self._plan(new.req_id, new.prompt_token_ids or [])
            plan.add_blocks(new.block_ids[0], replace=True)
            self._jobs(plan, new.num_computed_tokens + out.num_scheduled_tokens[new.req_id],
                       jobs)
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            cached_plan = self.plans.get(req_id)
            if cached_plan is None:
                continue
            plan = cached_plan
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                plan.add_blocks(new_ids[0], replace=req_id in cached.resumed_req_ids)
            self._jobs(plan, cached.num_computed_tokens[i] + out.num_scheduled_tokens[req_id],
                       jobs)
        return jobs

    def _jobs(self, plan: RequestPlan, end_tokens: int, jobs: StepJobs) -> None:
        if plan.recv is not None:
            recv = plan.recv_job()
            if recv is not None and recv.block_ids:
                jobs.recvs.append(recv)
        else:
            job = plan.load_job()
            if job is not None:
                jobs.loads.append(job)
        send = plan.send_job(end_tokens)
        if send is not None:
            jobs.sends.append(send)
        if self.save:
            jobs.saves.extend(plan.save_jobs(end_tokens))

    def finished(self, req_id: str) -> None:
        plan = self.plans.pop(req_id, None)
        if plan is not None and plan.send is not None:
            self.unsent.append(req_id)
