"""Test fake instances speaking the real control protocol (zmq ROUTER, `protocol.instance`).

All fakes of a test share one `FakeLoop` (an asyncio loop in a daemon thread), so a fake prefill
can hand a request to a fake decode directly (the real ones use a transfer-engine notification).
Timing and faults are controlled from the test thread: ``prefill_delay_s`` / ``step_s``,
``hang`` (never produce the first token), ``die_on_submit``, ``silence()`` (stop reports and replies: a hung
process, or a dead one behind a partition, as the Conductor sees it), ``restart()`` (killed and
started again at the same address: its connections drop), ``die_after_tokens`` (a decode that goes silent mid-stream).
Every control message received is recorded (``received``) and blocks are accounted
(``free_blocks``) so tests can check cancels and leaks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

import zmq
import zmq.asyncio

from yuebing.protocol import decode, encode
from yuebing.protocol.instance import (
    Ack,
    Breakdown,
    Cancel,
    DecodeTarget,
    ErrorCode,
    ErrorReply,
    EventKind,
    Hello,
    KvLayout,
    LoadReport,
    Ping,
    Reserve,
    Reserved,
    Role,
    SubmitTask,
    Subscribe,
    TaskEvent,
    TaskMode,
)

FINGERPRINT = "fake-fp"


def _logprobs(task: SubmitTask, tok: int) -> dict[str, Any]:
    """Made-up logprob fields of token ``tok`` when the task asked for logprobs: the token is
    the most likely one (-0.5), then ``tok + 1``, ``tok + 2``, ... ."""
    k = task.sampling.logprobs
    if k is None:
        return {}
    return {"logprobs": [-0.5], "top_ids": [[tok + i for i in range(k)]],
            "top_logprobs": [[-0.5 - i for i in range(k)]]}


class FakeLoop:
    """An asyncio loop in a daemon thread hosting fakes (`run` submits a coroutine)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.ctx = zmq.asyncio.Context()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.fakes: dict[str, FakeInstance] = {}

    def run(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
        fut: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout_s)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrap() -> Any:
            return fn()
        return self.run(wrap())

    def add(self, role: Role, name: str, **kw: Any) -> FakeInstance:
        fake = self.run(_make(self, role, name, kw))
        self.fakes[name] = fake
        return fake

    def close(self) -> None:
        for f in list(self.fakes.values()):
            self.run(f.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.ctx.term()


async def _make(fl: FakeLoop, role: Role, name: str, kw: dict[str, Any]) -> FakeInstance:
    f = FakeInstance(fl, role, name, **kw)
    f.start()
    return f


class FakeInstance:
    """One fake instance (see the module docstring)."""

    def __init__(self, fl: FakeLoop, role: Role, name: str, prefill_delay_s: float = 0.0,
                 step_s: float = 0.001, total_blocks: int = 1000, block_size: int = 16,
                 store_block_tokens: int = 256, max_model_len: int = 4096,
                 queued_prefill_tokens: int = 0, prefill_tokens_per_s: float = 10000.0,
                 layers: str = "", group: str = "") -> None:
        self.fl = fl
        self.layers, self.group = layers, group
        """A pipeline stage's layers ``A:B`` of 4 and ``--cpp-group`` ('' = a whole model)."""
        self.missing_prefix = False
        """A stage: refuse tasks that reuse a prefix (its store objects were evicted)."""
        self.role = role
        self.name = name
        self.prefill_delay_s = prefill_delay_s
        self.step_s = step_s
        self.total_blocks = total_blocks
        self.free_blocks = total_blocks
        self.block_size = block_size
        self.store_block_tokens = store_block_tokens
        self.max_model_len = max_model_len
        self.queued_prefill_tokens = queued_prefill_tokens
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.hang = False
        self.die_after_tokens: int | None = None
        self.die_before_handoff = False
        """Prefill: go silent right after the first token, before the KV reaches the decode."""
        self.die_on_submit = False
        """Go silent when a task arrives, before acknowledging it (no race with the heartbeat)."""
        self.silent = False
        self.cache: list[int] = []
        self.received: list[Any] = []
        self.held: dict[str, int] = {}
        self.owner: dict[str, bytes] = {}
        self.decoding: dict[str, int] = {}
        """Requests in their decode here → context tokens (what the reports' batch shows)."""
        self._changed: asyncio.Event | None = None
        self.subscribers: set[bytes] = set()
        self.sock = fl.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.incarnation = uuid.uuid4().hex
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cancelled: set[str] = set()
        self.prefilling = 0
        self.max_prefilling = 0
        """Most tasks this fake held at once between their submit and their first token."""

    # ---------------------------------------------------------------- control (test thread)

    def silence(self) -> None:
        """Stop answering and reporting, as a killed process would."""
        self.silent = True

    async def restart(self) -> None:
        """Die and come back at the same address, as ``kill -9`` and a restart would: the
        connections drop (a new socket on the same port), a new incarnation, no subscribers,
        and the old process's tasks and reservations are gone."""
        for t in list(self._tasks):
            t.cancel()
        self.sock.close(0)
        self.incarnation = uuid.uuid4().hex
        self.subscribers.clear()
        self.held.clear()
        self.owner.clear()
        self.free_blocks = self.total_blocks
        self.sock = self.fl.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        for _ in range(100):  # the old listener is closed by zmq's I/O thread, soon after
            try:
                self.sock.bind(self.address)
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.02)
        else:
            raise RuntimeError(f"{self.address} stayed in use")
        self.start()

    def kinds(self, cls: type) -> list[Any]:
        return [m for m in list(self.received) if isinstance(m, cls)]

    # ---------------------------------------------------------------- serving

    def start(self) -> None:
        self._spawn(self._serve())
        self._spawn(self._report())

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        t = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _serve(self) -> None:
        while True:
            ident, frame = await self.sock.recv_multipart()
            if self.silent:
                continue
            msg = decode(frame)
            self.received.append(msg)
            if self.die_on_submit and isinstance(msg, SubmitTask):
                self.silent = True
                continue
            reply = self._handle(ident, msg)
            if reply is not None:
                await self.sock.send_multipart([ident, encode(reply)])

    def _handle(self, ident: bytes, msg: Any) -> Any:
        if isinstance(msg, Subscribe):
            self.subscribers.add(ident)
            return self.hello(msg.seq)
        if isinstance(msg, Ping):
            return Ack(seq=msg.seq)
        if isinstance(msg, Reserve):
            need = -(-msg.prompt_tokens // self.block_size)
            if need > self.free_blocks:
                return ErrorReply(seq=msg.seq, code=ErrorCode.NO_KV, message="no room")
            self.free_blocks -= need
            self.held[msg.request_id] = need
            self.owner[msg.request_id] = ident
            layout = KvLayout(num_layers=2, num_blocks=self.total_blocks,
                              block_size=self.block_size, chunk_bytes=64,
                              fingerprint=FINGERPRINT)
            return Reserved(seq=msg.seq, target=DecodeTarget(
                instance_id=self.name, segment=f"seg-{self.name}", blocks=list(range(need)),
                layout=layout))
        if isinstance(msg, SubmitTask):
            self.owner[msg.request_id] = ident
            self._spawn(self._run(msg))
            return Ack(seq=msg.seq)
        if isinstance(msg, Cancel):
            self._cancelled.add(msg.request_id)
            known = self._free(msg.request_id)
            return Ack(seq=msg.seq) if known else ErrorReply(
                seq=msg.seq, code=ErrorCode.UNKNOWN_TASK, message="unknown")
        return ErrorReply(seq=getattr(msg, "seq", 0), code=ErrorCode.BAD_REQUEST,
                          message=f"unexpected {type(msg).__name__}")

    def hello(self, seq: int) -> Hello:
        return Hello(seq=seq, instance_id=self.name, role=self.role, model="fake",
                     fingerprint=FINGERPRINT, host="127.0.0.1", control_address=self.address,
                     kv_segment=f"seg-{self.name}", block_size=self.block_size,
                     store_block_tokens=self.store_block_tokens, num_blocks=self.total_blocks,
                     max_model_len=self.max_model_len, incarnation=self.incarnation,
                     layers=self.layers, num_layers=4 if self.layers else 0,
                     stage_segment=f"stage-{self.name}" if self.layers else "",
                     group=self.group)

    def _free(self, rid: str) -> bool:
        n = self.held.pop(rid, None)
        if n is not None:
            self.free_blocks += n
        return n is not None or rid in self.owner

    def _event(self, rid: str, kind: EventKind, **kw: Any) -> None:
        if self.silent or rid in self._cancelled:
            return
        ev = TaskEvent(request_id=rid, kind=kind, time_s=time.time(), **kw)
        self.sock.send_multipart([self.owner[rid], encode(ev)])  # queued at once (a Future)

    async def _run(self, task: SubmitTask) -> None:
        rid = task.request_id
        self.prefilling += 1
        self.max_prefilling = max(self.max_prefilling, self.prefilling)
        try:
            await asyncio.sleep(self.prefill_delay_s)  # the fake's configured prefill time
            while self.hang and not self.silent and rid not in self._cancelled:
                await asyncio.sleep(0.01)
        finally:
            self.prefilling -= 1
        if self.silent or rid in self._cancelled:
            return
        plan = task.stage
        if plan is not None and self.missing_prefix and plan.prefix_tokens > 0:
            self._event(rid, EventKind.ERROR, error_code=ErrorCode.PREFIX_MISSING,
                        error=f"layers {self.layers} hold 0 tokens of this prompt's prefix")
            return
        if plan is not None and plan.index < plan.count - 1:  # not the last: rows passed on
            self._event(rid, EventKind.FINISH, finish_reason="handoff")
            return
        first = 1000 + len(task.token_ids) % 100
        firsts = [first + 10 * j for j in range(task.sampling.n)]
        bd = Breakdown(queue_s=0.001, prefill_s=self.prefill_delay_s,
                       prefill_tokens=len(task.token_ids) - (task.prefix.tokens if task.prefix
                                                             else 0))
        for j, tok in enumerate(firsts):
            self._event(rid, EventKind.FIRST_TOKEN, token_ids=[tok],
                        token_times=[time.time()], text=f" t{tok}",
                        cached_tokens=task.prefix.tokens if task.prefix else 0,
                        prompt_tokens=len(task.token_ids), breakdown=bd if j == 0 else None,
                        index=j, **_logprobs(task, tok))
        if task.mode == TaskMode.PREFILL:
            assert task.decode is not None
            if self.die_before_handoff:
                self.silent = True
                return
            decode_fake = self.fl.fakes[task.decode.instance_id]
            self._event(rid, EventKind.FINISH, finish_reason="handoff",
                        breakdown=Breakdown(transfer_s=0.0005))
            self.owner.pop(rid, None)
            await decode_fake.kv_ready(task, firsts)
        else:
            await self._decode(task, firsts)

    async def kv_ready(self, task: SubmitTask, firsts: list[int]) -> None:
        self._spawn(self._decode(task, firsts))

    async def _decode(self, task: SubmitTask, firsts: list[int]) -> None:
        """``max_tokens`` tokens per choice (the first came from the prefill); each choice but
        the last ends with ``finish_reason`` on its last token, the last with FINISH."""
        rid = task.request_id
        n, last = task.sampling.max_tokens, len(firsts) - 1
        self.decoding[rid] = len(task.token_ids)
        self._load_changed()
        try:
            await self._decode_steps(task, firsts, n, last)
        finally:
            self.decoding.pop(rid, None)
            self._load_changed()

    def _load_changed(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _decode_steps(self, task: SubmitTask, firsts: list[int], n: int,
                            last: int) -> None:
        rid = task.request_id
        if n == 1:
            for j in range(last):
                self._event(rid, EventKind.TOKENS, index=j, finish_reason="length")
        for i in range(1, n):
            await asyncio.sleep(self.step_s)
            if self.die_after_tokens is not None and i > self.die_after_tokens:
                self.silent = True
            if self.silent or rid in self._cancelled:
                return
            for j, first in enumerate(firsts):
                tok = first + i
                self._event(rid, EventKind.TOKENS, token_ids=[tok], token_times=[time.time()],
                            text=f" t{tok}", index=j,
                            finish_reason="length" if i == n - 1 and j < last else None,
                            **_logprobs(task, tok))
        self._event(rid, EventKind.FINISH, finish_reason="length", index=last,
                    breakdown=Breakdown(decode_wait_s=0.0002))
        self._free(rid)
        self.owner.pop(rid, None)

    async def _report(self) -> None:
        """Every 50 ms, and at once when a decode starts or ends (as a real instance does)."""
        self._changed = asyncio.Event()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 0.05)
            self._changed.clear()
            if self.silent:
                continue
            r = LoadReport(instance_id=self.name, incarnation=self.incarnation,
                           report_seq=next(self._seq), time_s=time.time(),
                           queued_prefill_tokens=self.queued_prefill_tokens,
                           queued_requests=0, running=len(self.decoding), waiting=0,
                           context_tokens=sum(self.decoding.values()),
                           free_blocks=self.free_blocks, total_blocks=self.total_blocks,
                           reserved_blocks=sum(self.held.values()),
                           prefill_tokens_per_s=self.prefill_tokens_per_s, decode_step_s=0.01,
                           cache_added=list(self.cache), cache_full_resync=True)
            for ident in list(self.subscribers):
                await self.sock.send_multipart([ident, encode(r)])

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        self.sock.close(0)
