"""Prefill role: prefix load, chunked prefill, layer-wise KV streaming, hand-off, save.

Life cycle of a request: `SubmitTask(mode=PREFILL, decode=DecodeTarget)` is checked (same KV
layout as the decode's) and acknowledged; its prefix is loaded and it joins the engine
(``max_tokens=1``, ``hold_kv``) through the composed `coupled.CoupledRole`; its `KvStreamer`
writes each layer's K/V into the decode's reserved blocks while the next layer computes. The
first token goes out at once (`FIRST_TOKEN`, one per choice); then, off the TTFT path, the
writes are awaited, the decode is told (`KvReady` notification), the held blocks are released
and `FINISH` (``handoff``) ends this part. COUPLED tasks are the composed `CoupledRole`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from yuebing.engine.engine import LLMEngine
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.base import Instance, InstanceRole, Refused, Task, logprob_fields, to_params
from yuebing.instance.coupled import CoupledRole
from yuebing.instance.driver import DriverStopped
from yuebing.instance.streaming import KvStreamer, StreamResult
from yuebing.protocol import Message, encode
from yuebing.protocol.instance import (
    Ack,
    ErrorCode,
    EventKind,
    FetchPrefix,
    KvReady,
    Role,
    SubmitTask,
    TaskMode,
)

log = logging.getLogger(__name__)

KV_READY_TOPIC = "yuebing.kv_ready"


def _log_release(fut: concurrent.futures.Future[Any]) -> None:
    err = None if fut.cancelled() else fut.exception()
    if err is not None and not isinstance(err, DriverStopped):
        log.warning("releasing a handed-off request's blocks failed: %s", err)


class PrefillRole(InstanceRole):
    kind = Role.PREFILL

    def __init__(self, inst: Instance) -> None:
        super().__init__(inst)
        self.coupled = CoupledRole(inst)
        """Prefix loads, engine adds, saves, prefix serving, and the COUPLED tasks."""
        self.streamer = KvStreamer(inst.engine, inst.transfer, inst.cfg.transfer_timeout_s,
                                   inst.cfg.layerwise_min_bytes)
        self.upstream: Callable[[Task], Awaitable[str]] | None = None
        """Set by a pipeline group's last stage (`stage.StageRole`): awaited before the
        decode is told, it returns '' once every earlier stage's KV is there, else why not."""

    async def close(self) -> None:
        await self.coupled.close()

    async def on_fetch_prefix(self, msg: FetchPrefix) -> Message:
        return await self.coupled.on_fetch_prefix(msg)

    def on_output_driver(self, engine: LLMEngine, task: Task, out: RequestOutput) -> None:
        self.coupled.on_output_driver(engine, task, out)

    async def on_submit(self, ident: bytes, msg: SubmitTask,
                        then: Callable[[], None] | None = None) -> Message:
        """``then``: run once the engine add is queued (a pipeline stage feeds rows after)."""
        if msg.mode == TaskMode.COUPLED:
            return await self.coupled.on_submit(ident, msg)
        if msg.decode is None:
            raise Refused(ErrorCode.BAD_REQUEST, "a PREFILL task needs a decode target")
        if len(msg.decode.blocks) * self.inst.engine.block_size < len(msg.token_ids):
            raise Refused(ErrorCode.BAD_REQUEST,
                          f"the decode target's {len(msg.decode.blocks)} blocks cannot hold "
                          f"{len(msg.token_ids)} prompt tokens")
        task = Task(msg.request_id, ident, list(msg.token_ids), to_params(msg.sampling))
        task.target = msg.decode
        self.streamer.watch(task.request_id, msg.decode)  # ValueError: another KV layout
        self.inst.tasks[task.request_id] = task
        p = task.params
        self.coupled.start_task(task, msg, dataclasses.replace(
            p, max_tokens=1, min_tokens=min(p.min_tokens, 1)), hold_kv=True, then=then)
        return Ack(seq=msg.seq)

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        if task.target is None:
            self.coupled.on_output(task, out, step_start)
            return
        inst = self.inst
        if not out.new_token_ids:  # ended without a token: aborted or failed in the engine
            self.streamer.drop(task.request_id)
            inst.spawn(task, self.tell_decode_async(
                task, None, "the prefill ended without a first token"))
            inst.fail(task, ErrorCode.INTERNAL, "the prefill ended without a first token")
            return
        firsts = task.firsts
        first_at = time.time() if task.first_at is None else task.first_at
        if not firsts:
            if task.started is not None:
                task.breakdown.prefill_s = first_at - task.started
            task.cached_tokens = out.num_cached_tokens
        firsts[out.index] = out.new_token_ids[0]
        task.outputs = 1
        inst.event(task, EventKind.FIRST_TOKEN, token_ids=list(out.new_token_ids),
                    token_times=[first_at], text=out.text_delta,
                    cached_tokens=out.num_cached_tokens, prompt_tokens=len(task.token_ids),
                    index=out.index, **logprob_fields(out))
        if len(firsts) == task.params.n:
            tokens = [firsts[j] for j in range(task.params.n)]
            inst.spawn(task, self._hand_off(task, tokens, first_at))

    async def _hand_off(self, task: Task, tokens: list[int], first_at: float) -> None:
        if self.upstream is not None and (err := await self.upstream(task)):
            self.streamer.drop(task.request_id)
            await self.tell_decode_async(task, None, err)
            self.inst.driver.call(lambda e: e.release(task.request_id))
            if not task.done:
                self.inst.fail(task, ErrorCode.TRANSFER, err)
            return
        result, err = await asyncio.get_running_loop().run_in_executor(
            None, self._finish_stream, task, tokens, first_at)
        if task.done:
            return  # cancelled while streaming
        if not result.ok:
            self.inst.fail(task, ErrorCode.TRANSFER, f"streaming KV to the decode failed: "
                           f"{result.error}")
            return
        if err:
            self.inst.fail(task, ErrorCode.TRANSFER, f"notifying the decode failed: {err}")
            return
        b = task.breakdown
        b.transfer_s = max(0.0, result.complete_at - result.last_layer_at)
        b.kv_bytes, b.streamed_layers = result.bytes, result.layers
        b.layers_before_prefill_end = result.layers_before_last
        self.inst.finish(task, "handoff")

    def _finish_stream(self, task: Task, tokens: list[int],
                       first_at: float) -> tuple[StreamResult, str]:
        """Executor thread, one hop for the whole hand-off: wait for the request's KV writes,
        tell the decode (`KvReady`, or its failure), queue the release of the held blocks to
        the driver (not awaited). Returns the stream's result and the notify's error."""
        rid = task.request_id
        try:
            result = self.streamer.finish(rid)
            if task.done:
                return result, ""
            if not result.ok:
                return result, self._tell_decode(task, None, result.error)
            prefill_end = time.time() - (time.perf_counter() - result.last_layer_at)
            return result, self._tell_decode(task, (tokens, first_at, prefill_end))
        finally:
            self.inst.driver.call(lambda e: e.release(rid)).add_done_callback(_log_release)

    async def tell_decode_async(self, task: Task,
                                 first: tuple[list[int], float, float] | None,
                                 error: str = "") -> str:
        return await asyncio.get_running_loop().run_in_executor(
            None, self._tell_decode, task, first, error)

    def _tell_decode(self, task: Task, first: tuple[list[int], float, float] | None,
                     error: str = "") -> str:
        """Send `KvReady` to the decode (any thread); returns an error text or ''."""
        target = task.target
        assert target is not None, "only PREFILL tasks tell a decode"
        tokens, first_at, prefill_end = first if first is not None else ([0], 0.0, 0.0)
        msg = KvReady(request_id=task.request_id, num_tokens=len(task.token_ids),
                      first_token=tokens[0], first_token_time_s=first_at,
                      prefill_end_s=prefill_end, cached_tokens=task.cached_tokens,
                      ok=first is not None, error=error,
                      first_tokens=tokens if len(tokens) > 1 else [])
        try:
            self.inst.transfer.notify(target.segment, KV_READY_TOPIC, encode(msg),
                                      timeout_s=self.inst.cfg.transfer_timeout_s)
        except Exception as e:
            log.warning("%s: KvReady to %s failed: %s", task.request_id, target.instance_id, e)
            return str(e)
        return ""

    async def on_cancel(self, request_id: str) -> bool:
        """Answered once no KV write of the request is in flight any more (the Conductor then
        cancels the decode, which may free the reserved blocks)."""
        timeout = self.inst.cfg.transfer_timeout_s
        quiet = await asyncio.get_running_loop().run_in_executor(
            None, self.streamer.drop, request_id, timeout)
        if not quiet:
            log.warning("%s: KV writes still in flight after %.0f s", request_id, timeout)
        return await self.coupled.on_cancel(request_id)
