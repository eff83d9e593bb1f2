"""`StageRole`: one stage of a chunked pipeline parallel prefill group (``--layers A:B``).

Every stage of the group gets the same `SubmitTask(mode=PREFILL)` with its `StagePlan` and the
decode's reservation, and joins the engine (``hold_kv``) through the composed
`prefill.PrefillRole`, whose `KvStreamer` writes this stage's layers into the decode's blocks.
A stage before the last sends each chunk's boundary rows on (`stagelink.StageLink`) as soon as
it ran, then its `StageDone` (`_pass_on`); the last samples the first token and sends the
decode `KvReady` once the previous `StageDone` came. A failure ends the request on every later
stage (`_end`, `sweep`), and the decode hears `KvReady` with ``ok`` False.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from yuebing.engine.engine import LLMEngine
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.base import Instance, InstanceRole, Refused, Task
from yuebing.instance.prefill import PrefillRole
from yuebing.instance.stagelink import StageLink
from yuebing.protocol import Message
from yuebing.protocol.instance import ErrorCode, FetchPrefix, Role, SubmitTask, TaskMode

log = logging.getLogger(__name__)

OUT_CHUNKS = 8
"""Chunks of boundary rows a stage can have in flight to the next before it waits."""


@dataclass
class _Group:
    """One request's place in its group, on this stage."""

    index: int
    count: int
    next_segment: str
    upstream: asyncio.Future[str]
    """The previous stage's `StageDone`: '' ok, else its error (the first stage: '' at once)."""
    heard_at: float = field(default_factory=time.monotonic)
    """When rows or the request itself last arrived (a stalled previous stage times out)."""
    added: bool = False
    """Its engine add is queued (after a store prefix load): rows can be fed."""


class StageRole(InstanceRole):
    kind = Role.PREFILL

    def __init__(self, inst: Instance) -> None:
        super().__init__(inst)
        self.prefill = PrefillRole(inst)
        """The KV streaming to the decode, the last stage's first token and hand-off."""
        self.prefill.upstream = self._upstream
        e = inst.engine
        chunk = e.config.max_batch_tokens * e.model_config.hidden_size * 2 * e.dtype.itemsize
        self.link = StageLink(inst.transfer, OUT_CHUNKS * chunk, inst.cfg.transfer_timeout_s,
                              self._rows_from_link, self._done_from_link, self._failed_from_link)
        self.groups: dict[str, _Group] = {}
        self.early: dict[str, tuple[float, list[tuple[int, torch.Tensor, torch.Tensor]],
                                    tuple[bool, str] | None]] = {}
        """Rows (and a `StageDone`) that came before their request (arrival time first)."""
        self.upstream_heard = 0.0
        """When rows of any request last came from the previous stage: a stage queued behind
        other work is busy, not quiet."""

    @property
    def stage_segment(self) -> str:
        return self.link.segment

    async def close(self) -> None:
        self.link.close()
        await self.prefill.close()

    async def on_fetch_prefix(self, msg: FetchPrefix) -> Message:
        raise Refused(ErrorCode.BAD_REQUEST, "a pipeline stage serves no prefixes (it holds "
                      f"layers {self.inst.cfg.engine.layers} only)")

    def on_output_driver(self, engine: LLMEngine, task: Task, out: RequestOutput) -> None:
        """Right after the step that took the prompt through this stage: its layers' new
        store blocks are saved (objects ``...@A:B``, `kvkeys.store_key`)."""
        if not out.finished or (out.boundary is None and not out.new_token_ids):
            return
        if out.new_token_ids:
            task.first_at = time.time()
        inst = self.inst
        if inst.cfg.save_to_store:
            snap = inst.connector.snapshot(engine, task.token_ids)
            if snap is not None:
                inst.connector.submit_save(snap)

    # ------------------------------------------------------------------ tasks

    async def on_submit(self, ident: bytes, msg: SubmitTask) -> Message:
        plan, model = msg.stage, self.inst.engine.model
        if plan is None or msg.mode != TaskMode.PREFILL:
            raise Refused(ErrorCode.BAD_REQUEST, f"a pipeline stage (layers "
                          f"{self.inst.cfg.engine.layers}) takes only PREFILL tasks of a group "
                          f"(SubmitTask.stage)")
        last = plan.index == plan.count - 1
        if not 0 <= plan.index < plan.count or (plan.index == 0) != model.is_first or \
                last != model.is_last or last != (not plan.next_segment):
            raise Refused(ErrorCode.BAD_REQUEST, f"stage {plan.index} of {plan.count} (next "
                          f"{plan.next_segment!r}) does not fit layers "
                          f"{self.inst.cfg.engine.layers} of {self.inst.engine.model_config.num_layers}")
        if msg.sampling.n > 1:
            raise Refused(ErrorCode.BAD_REQUEST, "a pipeline group samples one choice (n = 1)")
        if msg.prefix is not None and msg.prefix.source not in ("local", "store"):
            raise Refused(ErrorCode.BAD_REQUEST, "a pipeline stage loads a prefix from its "
                          "own cache or the store (its layers' objects), not a peer")
        upstream: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if plan.index == 0:
            upstream.set_result("")
        rid = msg.request_id
        self.groups[rid] = _Group(plan.index, plan.count, plan.next_segment, upstream)
        try:
            return await self.prefill.on_submit(ident, msg, lambda: self._added(rid))
        except BaseException:
            self.groups.pop(rid, None)
            raise

    def _added(self, rid: str) -> None:
        """The request's engine add is queued: feed the rows that came before it."""
        g = self.groups.get(rid)
        if g is None:
            return
        g.added, g.heard_at = True, time.monotonic()
        _, rows, done = self.early.pop(rid, (0.0, [], None))
        for start, residual, x in rows:
            self._feed(rid, start, residual, x)
        if done is not None:
            self._done(rid, *done)

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        g = self.groups.get(task.request_id)
        if g is None:
            return
        if g.index == g.count - 1:
            self.prefill.on_output(task, out, step_start)
            return
        if out.boundary is not None:
            self.link.send_rows(task.request_id, g.next_segment, *out.boundary)
        if out.finished:
            if out.boundary is None:  # aborted or failed in the engine
                self._end(task, "the stage's prefill ended in the engine")
                return
            if task.started is not None:
                task.breakdown.prefill_s = time.time() - task.started
            self.inst.spawn(task, self._pass_on(task, g))

    async def _pass_on(self, task: Task, g: _Group) -> None:
        """A stage before the last, its prompt through: wait for its KV writes and the previous
        stage's `StageDone`, then send its own, release the blocks, end its part."""
        rid = task.request_id
        result = await asyncio.get_running_loop().run_in_executor(
            None, self.prefill.streamer.finish, rid)
        err = "" if result.ok else f"streaming KV to the decode failed: {result.error}"
        err = err or await self._upstream(task)
        self.link.send_done(rid, g.next_segment, not err, err)
        self.inst.driver.call(lambda e: e.release(rid))
        self.groups.pop(rid, None)
        if task.done:
            return
        if err:
            self.inst.fail(task, ErrorCode.TRANSFER, err)
            return
        b = task.breakdown
        b.kv_bytes, b.streamed_layers = result.bytes, result.layers
        b.layers_before_prefill_end = result.layers_before_last
        b.transfer_s = max(0.0, result.complete_at - result.last_layer_at)
        self.inst.finish(task, "handoff")

    async def _upstream(self, task: Task) -> str:
        """'' once every earlier stage's KV reached the decode, else why not (a timeout)."""
        g = self.groups.get(task.request_id)
        if g is None:
            return "the request left its pipeline group"
        timeout = self.inst.cfg.transfer_timeout_s
        try:
            return await asyncio.wait_for(asyncio.shield(g.upstream), timeout)
        except TimeoutError:
            return f"the previous pipeline stage sent no StageDone within {timeout:.0f} s"

    def _end(self, task: Task, error: str) -> None:
        """End ``task`` here with ``error`` and tell the later stages (not the decode: the
        last stage does that when it hears of it)."""
        rid = task.request_id
        g = self.groups.pop(rid, None)
        self.prefill.streamer.drop(rid)
        if g is not None and g.next_segment:
            self.link.send_done(rid, g.next_segment, False, error)
        if g is not None and not g.upstream.done():
            g.upstream.set_result(error)
        if not task.done:
            if g is not None and not g.next_segment and task.target is not None:
                self.inst.spawn(task, self.prefill.tell_decode_async(task, None, error))
            self.inst.driver.call(lambda e: e.abort(rid))
            self.inst.fail(task, ErrorCode.TRANSFER, error)

    async def on_cancel(self, request_id: str) -> bool:
        g = self.groups.pop(request_id, None)
        self.early.pop(request_id, None)
        if g is not None and g.next_segment:
            self.link.send_done(request_id, g.next_segment, False, "cancelled")
        if g is not None and not g.upstream.done():
            g.upstream.set_result("cancelled")
        return await self.prefill.on_cancel(request_id)

    def sweep(self) -> None:
        """A later stage whose previous stage went quiet (killed, cut off) ends its request;
        rows of requests that never came are dropped."""
        now, timeout = time.monotonic(), self.inst.cfg.transfer_timeout_s
        for rid, g in list(self.groups.items()):
            task = self.inst.tasks.get(rid)
            if task is None:
                self.groups.pop(rid, None)
            elif g.index > 0 and not g.upstream.done() and \
                    now - max(g.heard_at, self.upstream_heard) > timeout:
                self._end(task, f"the previous pipeline stage went quiet for {timeout:.0f} s")
        for rid in [r for r, (t, _, _) in self.early.items() if now - t > timeout]:
            self.early.pop(rid, None)

    # ------------------------------------------------------------------ from the link

    def _post(self, fn: object, *args: object) -> None:
        loop = self.inst.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(fn, *args)  # type: ignore[arg-type]

    def _rows_from_link(self, rid: str, start: int, residual: torch.Tensor,
                        x: torch.Tensor) -> None:
        self._post(self._rows, rid, start, residual, x)

    def _done_from_link(self, rid: str, ok: bool, error: str) -> None:
        self._post(self._done, rid, ok, error)

    def _failed_from_link(self, rid: str, error: str) -> None:
        self._post(self._failed, rid, error)

    def _rows(self, rid: str, start: int, residual: torch.Tensor, x: torch.Tensor) -> None:
        self.upstream_heard = time.monotonic()
        g = self.groups.get(rid)
        if g is not None and g.added:
            self._feed(rid, start, residual, x)
        elif g is not None or rid not in self.inst.tasks:
            entry = self.early.setdefault(rid, (time.monotonic(), [], None))
            entry[1].append((start, residual, x))

    def _feed(self, rid: str, start: int, residual: torch.Tensor, x: torch.Tensor) -> None:
        task, g = self.inst.tasks.get(rid), self.groups.get(rid)
        if task is None or g is None:
            return
        g.heard_at = time.monotonic()

        def fed(fut: object) -> None:
            err = getattr(fut, "exception", lambda: None)()
            if err is not None and not task.done:
                self._end(task, f"the previous stage's rows were refused: {err}")
        self.inst.driver_then(task, lambda e: e.feed(rid, start, residual, x), fed)

    def _done(self, rid: str, ok: bool, error: str) -> None:
        g = self.groups.get(rid)
        if g is None or not g.added:
            if g is not None or rid not in self.inst.tasks:
                t, rows, _ = self.early.get(rid, (time.monotonic(), [], None))
                self.early[rid] = (t, rows, (ok, error))
            return
        if not g.upstream.done():
            g.upstream.set_result("" if ok else error or "a previous pipeline stage failed")
        task = self.inst.tasks.get(rid)
        if not ok and task is not None and not task.done and task.firsts == {}:
            self._end(task, error or "a previous pipeline stage failed")

    def _failed(self, rid: str, error: str) -> None:
        task = self.inst.tasks.get(rid)
        if task is not None and not task.done:
            self._end(task, error)
