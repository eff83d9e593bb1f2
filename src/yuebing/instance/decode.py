"""Decode role: reservations, KV received in place, continuous batching, token streaming.

Life cycle of a request: `Reserve` allocates the blocks its prompt's KV needs (`NO_KV` when the
pool cannot hold them with ``kv_headroom_blocks`` to spare) and answers `Reserved` with the KV
pool's segment, layout and block ids. The prefill writes each layer into those blocks, then
sends `KvReady` (transfer notification `KV_READY_TOPIC`); the request is adopted into the
engine with each choice's first token and decodes in the continuous batch, its tokens streamed
to the connection that reserved it. No KV in time, `KvReady(ok=False)` or `Cancel` frees the
blocks, after a fence of ``FENCE_S`` when a prefill may still be writing into them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from yuebing.engine.engine import LLMEngine
from yuebing.engine.kv_transfer import adopt_choices, reserve_blocks
from yuebing.engine.sequence import RequestOutput
from yuebing.instance.base import Instance, InstanceRole, Refused, Task, to_params
from yuebing.instance.prefill import KV_READY_TOPIC
from yuebing.protocol import Message, ProtocolError, decode
from yuebing.protocol.instance import (
    DecodeTarget,
    ErrorCode,
    KvLayout,
    KvReady,
    Reserve,
    Reserved,
    Role,
)
from yuebing.transfer.types import Notification

log = logging.getLogger(__name__)

FENCE_S = 2.0
"""Freed reservations wait this long before their blocks are reused (a prefill that was
cancelled may have one layer's writes in flight)."""


class DecodeRole(InstanceRole):
    kind = Role.DECODE
    uses_store = False
    exposes_pool = True

    def __init__(self, inst: Instance) -> None:
        super().__init__(inst)
        self.fence_s = FENCE_S
        self._fenced: list[tuple[float, list[int]]] = []
        inst.transfer.on_notify(self._notified)
        pool = inst.engine.pool
        self.layout = KvLayout(num_layers=pool.num_layers, num_blocks=pool.num_blocks,
                               block_size=pool.block_size, chunk_bytes=pool.chunk_nbytes,
                               fingerprint=inst.engine.fingerprint)

    # ------------------------------------------------------------------ reservations

    async def on_reserve(self, ident: bytes, msg: Reserve) -> Message:
        ids = list(msg.token_ids)
        if len(ids) != msg.prompt_tokens:
            raise Refused(ErrorCode.BAD_REQUEST, f"prompt_tokens={msg.prompt_tokens} but "
                          f"{len(ids)} token ids were sent")
        self.inst.check_prompt(ids)
        if not msg.timeout_s > 0:
            raise Refused(ErrorCode.BAD_REQUEST, f"timeout_s must be > 0, got {msg.timeout_s}")
        params = to_params(msg.sampling)
        headroom = self.inst.cfg.kv_headroom_blocks

        def reserve(e: LLMEngine) -> list[int]:
            need = -(-len(ids) // e.block_size)
            forks = (params.n - 1) * (1 if len(ids) % e.block_size else 0)  # copied last blocks
            if e.allocator.num_free - need - forks < headroom:
                raise Refused(ErrorCode.NO_KV, f"KV cache has {e.allocator.num_free} free "
                              f"blocks; the request needs {need + forks} and {headroom} are "
                              "kept free")
            return reserve_blocks(e, len(ids))

        blocks = await self.inst.driver.run(reserve)
        task = Task(msg.request_id, ident, ids, params)
        timeout = min(msg.timeout_s, self.inst.cfg.reserve_timeout_s)
        task.blocks, task.deadline = blocks, time.monotonic() + timeout
        self.inst.tasks[task.request_id] = task
        return Reserved(seq=msg.seq, target=DecodeTarget(
            instance_id=self.inst.instance_id, segment=self.inst.transfer.segment_name("kv"),
            blocks=blocks, layout=self.layout, expires_at_s=time.time() + timeout))

    def reserved_blocks(self) -> int:
        return sum(len(t.blocks) for t in self.inst.tasks.values()
                   if t.blocks is not None and not t.adopted)

    @staticmethod
    def _take_blocks(task: Task) -> list[int]:
        """``task``'s reserved blocks, no longer its own (none: [])."""
        blocks, task.blocks = task.blocks or [], None
        return blocks

    def _free_later(self, blocks: list[int]) -> None:
        if blocks:
            self._fenced.append((time.monotonic() + self.fence_s, blocks))

    def sweep(self) -> None:
        now = time.monotonic()
        for task in list(self.inst.tasks.values()):
            if not task.adopted and task.deadline is not None and task.deadline <= now:
                self._free_later(self._take_blocks(task))
                self.inst.fail(task, ErrorCode.TRANSFER, "no KV arrived for the reservation in time")
        due = [b for t, b in self._fenced if t <= now]
        if due:
            self._fenced = [(t, b) for t, b in self._fenced if t > now]
            def release(e: LLMEngine) -> None:
                for b in due:
                    e.allocator.release_all(b)
            loop = self.inst.loop
            fut = self.inst.driver.call(release)
            if loop is not None:
                fut.add_done_callback(lambda _: loop.call_soon_threadsafe(self.inst.changed))

    # ------------------------------------------------------------------ KV arrival

    def _notified(self, n: Notification) -> None:
        """Transfer-engine thread: a prefill's `KvReady`."""
        if n.topic != KV_READY_TOPIC:
            log.warning("ignored a notification on topic %r", n.topic)
            return
        try:
            msg: KvReady = decode(n.payload, KvReady)  # type: ignore[assignment]
        except ProtocolError as e:
            log.warning("bad KvReady from %s: %s", n.sender, e)
            return
        if self.inst.loop is not None:
            self.inst.loop.call_soon_threadsafe(self._kv_ready, msg, time.time())

    def _kv_ready(self, msg: KvReady, arrived: float) -> None:
        task = self.inst.tasks.get(msg.request_id)
        if task is None or task.adopted or task.blocks is None:
            log.info("KvReady for unknown or finished request %s ignored", msg.request_id)
            return
        if not msg.ok:
            self._free_later(self._take_blocks(task))
            self.inst.fail(task, ErrorCode.TRANSFER, f"the prefill failed: {msg.error}")
            return
        firsts = list(msg.first_tokens) or [msg.first_token]
        if msg.num_tokens != len(task.token_ids) or len(firsts) != task.params.n:
            self._free_later(self._take_blocks(task))
            self.inst.fail(task, ErrorCode.BAD_REQUEST, f"KvReady covers {msg.num_tokens} tokens "
                      f"and {len(firsts)} choices, the reservation {len(task.token_ids)} and "
                      f"{task.params.n}")
            return
        task.adopted = True
        task.ready_at = arrived
        task.cached_tokens = msg.cached_tokens
        task.outputs = 1  # the prefill sent the first token
        task.breakdown.transfer_s = max(0.0, arrived - msg.prefill_end_s) if msg.prefill_end_s \
            else 0.0
        blocks = task.blocks
        rid, ids, params = task.request_id, task.token_ids, task.params
        self.inst.driver_then(task, lambda e: adopt_choices(
            e, rid, ids, blocks, firsts, params, msg.cached_tokens),
            lambda f: self._adopted(task, blocks, f))

    def _adopted(self, task: Task, blocks: list[int],
                 fut: concurrent.futures.Future[list[RequestOutput]]) -> None:
        """Loop thread: the driver ran `adopt_choices` for ``task``."""
        err = fut.exception()
        if err is not None:
            self.inst.driver.call(lambda eng: eng.allocator.release_all(blocks))
            if not task.done:
                self.inst.fail(task, ErrorCode.INTERNAL, f"adopting the request failed: {err}")
            return
        if task.done:  # cancelled while adopting
            self.inst.driver.call(lambda e: e.abort(task.request_id))
            return
        for out in fut.result():  # each choice's first token (sent by the prefill)
            if out.finished and out.done:
                self.inst.finish(task, out.finish_reason or "stop", index=out.index)
            elif out.finished:
                self.inst.end_choice(task, out.index, out.finish_reason or "stop")

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        if not task.waited and task.ready_at is not None:
            task.waited = True
            task.breakdown.decode_wait_s = max(0.0, step_start - task.ready_at)
        self.inst.stream_output(task, out)

    async def on_cancel(self, request_id: str) -> bool:
        task = self.inst.tasks.pop(request_id, None)
        if task is None:
            return await self.inst.driver.run(lambda e: e.abort(request_id))
        task.done = True
        if task.adopted:
            await self.inst.driver.run(lambda e: e.abort(request_id))
        else:
            self._free_later(self._take_blocks(task))
        return True
