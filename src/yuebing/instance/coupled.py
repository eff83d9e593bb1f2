"""Coupled role (the vLLM-like baseline): prefill and decode in one engine.

Life cycle of a request: `SubmitTask(mode=COUPLED)` is checked and acknowledged; its planned
prefix is loaded from the store or a peer (`prefix.load_prefix`; a local plan needs nothing);
it joins the engine's continuous batch; right after the step of its first token (driver thread)
its new full store blocks are saved in the background; every output becomes a `TaskEvent`.
`Cancel` aborts it. A peer's `FetchPrefix` is served from this engine's prefix cache.
`prefill.PrefillRole` composes one of these for its prefix loads and COUPLED tasks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from typing import Any

from yuebing.core.errors import PrefixMissing
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.base import Instance, InstanceRole, Refused, Task, to_params
from yuebing.instance.prefix import PeerClients, load_prefix, serve_fetch
from yuebing.protocol import Message
from yuebing.protocol.instance import Ack, ErrorCode, FetchPrefix, Role, SubmitTask, TaskMode

log = logging.getLogger(__name__)


class CoupledRole(InstanceRole):
    kind = Role.COUPLED

    def __init__(self, inst: Instance) -> None:
        super().__init__(inst)
        self.peers = PeerClients()
        """Clients of the instances this one fetches prefixes from (`prefix.fetch_from_peer`)."""
        inst.engine.add_layer_hook(self._mark_started)

    async def close(self) -> None:
        await self.peers.close()

    async def on_fetch_prefix(self, msg: FetchPrefix) -> Message:
        return await serve_fetch(self.inst, msg)

    async def on_submit(self, ident: bytes, msg: SubmitTask) -> Message:
        if msg.mode != TaskMode.COUPLED:
            raise Refused(ErrorCode.BAD_REQUEST, f"a {self.inst.kind.label} instance runs "
                          f"COUPLED tasks, got {msg.mode.name}")
        task = Task(msg.request_id, ident, list(msg.token_ids), to_params(msg.sampling))
        self.inst.tasks[task.request_id] = task
        self.start_task(task, msg, task.params)
        return Ack(seq=msg.seq)

    def start_task(self, task: Task, msg: SubmitTask, params: SamplingParams,
                   hold_kv: bool = False, then: Callable[[], None] | None = None) -> None:
        """Queue the request in the engine with ``params`` now when its prefix plan loads
        nothing (no task, no await), else load the prefix in the background first; ``then``
        runs on the loop right after the add is queued. A pipeline stage's task reuses exactly
        its group's ``StagePlan.prefix_tokens``."""
        plan = msg.prefix
        reuse = None if msg.stage is None else msg.stage.prefix_tokens
        if plan is None or plan.tokens <= 0 or plan.source == "local":
            self._add(task, params, hold_kv, reuse)
            if then is not None:
                then()
        else:
            self.inst.spawn(task, self._load_then_add(task, msg, params, hold_kv, reuse, then))

    async def _load_then_add(self, task: Task, msg: SubmitTask, params: SamplingParams,
                             hold_kv: bool, reuse: int | None,
                             then: Callable[[], None] | None) -> None:
        """Load the prefix, then queue the request in the engine (events follow)."""
        task.loading = True
        try:
            task.cached_tokens = await load_prefix(self.inst, self.peers, task, msg.prefix)
        except Refused as e:
            self.inst.fail(task, e.code, str(e))
            return
        except Exception as e:
            log.warning("%s: prefix load failed, computing it: %s", task.request_id, e)
        finally:
            task.loading = False
        if task.done or task.request_id not in self.inst.tasks:
            return  # cancelled meanwhile
        self._add(task, params, hold_kv, reuse)
        if then is not None:
            then()

    def _add(self, task: Task, params: SamplingParams, hold_kv: bool,
             prefix_tokens: int | None = None) -> None:
        """A driver call adding the request, not awaited: only a refusal comes back to the
        loop (as the task's error)."""
        rid, ids = task.request_id, task.token_ids
        self.inst.driver_then(task, lambda e: e.add_request(
            ids, params, rid, hold_kv=hold_kv, prefix_tokens=prefix_tokens),
            lambda f: self._added(task, f))

    def _added(self, task: Task, fut: concurrent.futures.Future[Any]) -> None:
        err = None if fut.cancelled() else fut.exception()
        if err is not None and not task.done:
            code = ErrorCode.PREFIX_MISSING if isinstance(err, PrefixMissing) \
                else ErrorCode.INTERNAL
            self.inst.fail(task, code, f"the engine refused the request: {err}")

    def _mark_started(self, layer: int, meta: object) -> None:
        """Layer hook (driver thread): stamp when a task's first prefill chunk runs, and count
        the prompt tokens each step computes for it (`Breakdown.prefill_tokens`). A request
        whose prompt is all cached but its last token joins the decodes (``plan.joined``):
        that token is its prefill."""
        plan = self.inst.engine.current_plan
        if layer != 0 or plan is None:
            return
        now = time.time()
        for seq, n in (*plan.prefills, *((seq, 1) for seq in plan.joined)):
            task = self.inst.tasks.get(seq.group)
            if task is None:
                continue
            task.breakdown.prefill_tokens += min(n, max(0, len(seq.prompt_ids) -
                                                         seq.num_computed))
            if task.started is None:
                task.started = now
                task.thread_mark = self.inst.driver.marks()
                task.breakdown.queue_s = max(0.0, now - task.arrived -
                                             task.breakdown.prefix_load_s)

    def on_output_driver(self, engine: LLMEngine, task: Task, out: RequestOutput) -> None:
        if len(out.output_token_ids) != 1 or not out.new_token_ids or out.index:
            return  # only right after the prefill (once for all choices)
        task.first_at = time.time()
        if task.thread_mark is not None:
            task.breakdown.prefill_threads = self.inst.driver.mean_threads(task.thread_mark)
        inst = self.inst
        inst.local_cache.note(engine, task.token_ids)
        if inst.cfg.save_to_store:
            snap = inst.connector.snapshot(engine, task.token_ids)
            if snap is not None:
                inst.connector.submit_save(snap)

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        if task.outputs == 0 and task.started is not None:
            first_at = time.time() if task.first_at is None else task.first_at
            task.breakdown.prefill_s = first_at - task.started
        self.inst.stream_output(task, out)

    async def on_cancel(self, request_id: str) -> bool:
        task = self.inst.tasks.pop(request_id, None)
        if task is not None:
            task.done = True
        aborted = await self.inst.driver.run(lambda e: e.abort(request_id))
        return task is not None or aborted
