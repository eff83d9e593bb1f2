"""`Instance`: the host every serving role runs on — engine + driver thread, transfer engine,
KV connector, control server (`control.ControlServer`), tasks, events and load reports — and
`InstanceRole`, the seam it calls a role through: `dispatch` hands it control requests,
`on_outputs` each engine output; the role answers through the host (`stream_output`,
`finish`, `fail`). The roles are siblings above it: `coupled.CoupledRole`, `prefill.PrefillRole`
(composing a `CoupledRole`), `stage.StageRole` (a prefill of layers ``A:B``) and
`decode.DecodeRole`; `run.build_instance` picks one.

Threads: the asyncio control loop (never blocks on a step), the engine's driver thread, the
connector's store threads, the transfer engine's. Only the driver thread keeps an OpenMP pool
(`runtime.release_openmp_pool`: two pools make libgomp's barriers sleep). Engine outputs reach
the wire in one pass on the loop (`on_outputs`: one `TaskEvents` frame per connection).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import secrets
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from yuebing.engine import runtime
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.sequence import RequestOutput
from yuebing.instance import profile_cache
from yuebing.instance.config import InstanceConfig
from yuebing.instance.connector import KVConnector, KVConnectorConfig
from yuebing.instance.control import ControlServer, Refused  # roles import Refused here
from yuebing.instance.cores import CoreLedger, host_cores
from yuebing.instance.driver import EngineDriver
from yuebing.instance.reports import LocalCache, report_loop
from yuebing.instance.startup_profile import startup_profile
from yuebing.protocol import Message
from yuebing.protocol.instance import (
    Ack,
    Breakdown,
    Cancel,
    DecodeTarget,
    ErrorCode,
    EventKind,
    FetchPrefix,
    Hello,
    Ping,
    Reserve,
    Role,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskEvent,
    TaskEvents,
)
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.engine import TransferEngine

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(slots=True)
class Task:
    """One request on this instance: what every role keeps, then what one role adds (left at
    its default by the others)."""

    request_id: str
    owner: bytes
    """zmq identity of the Conductor connection that submitted it (events go there)."""
    token_ids: list[int]
    params: SamplingParams
    arrived: float = field(default_factory=time.time)
    cached_tokens: int = 0
    breakdown: Breakdown = field(default_factory=Breakdown)
    outputs: int = 0
    done: bool = False
    # roles that prefill (coupled, prefill)
    loading: bool = False
    """Its planned prefix is being loaded (its prompt counts as pending, not yet in the engine)."""
    started: float | None = None
    """When its first prefill chunk ran (wall clock; driver thread)."""
    thread_mark: tuple[float, float] | None = None
    """The driver's `EngineDriver.marks` before its first prefill chunk ran."""
    first_at: float | None = None
    """When the step that sampled its first token ended (wall clock; driver thread)."""
    # prefill
    target: DecodeTarget | None = None
    """A PREFILL task's decode reservation (None: a COUPLED task)."""
    firsts: dict[int, int] = field(default_factory=dict)
    """First token per choice index, sent together in `KvReady` once every choice has one."""
    # decode
    blocks: list[int] | None = None
    """The reserved KV blocks until the request is adopted or they are freed."""
    deadline: float | None = None
    """`time.monotonic()` by which its KV must arrive (a reservation)."""
    adopted: bool = False
    """Its KV arrived and the engine runs it."""
    ready_at: float | None = None
    """When its `KvReady` arrived (wall clock)."""
    waited: bool = False
    """Its decode wait (`Breakdown.decode_wait_s`) is recorded."""


def to_params(s: Sampling, max_tokens: int | None = None) -> SamplingParams:
    """Wire sampling → engine `SamplingParams` (raises `InputError` for bad values)."""
    return SamplingParams(max_tokens=s.max_tokens if max_tokens is None else max_tokens,
                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                          stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids),
                          ignore_eos=s.ignore_eos,
                          min_tokens=min(s.min_tokens, s.max_tokens if max_tokens is None
                                         else max_tokens), n=s.n, logprobs=s.logprobs)


def logprob_fields(out: RequestOutput) -> dict[str, Any]:
    """The logprob fields of the `TaskEvent` carrying ``out``'s new tokens (none unless the
    request asked for logprobs)."""
    lps = [lp for lp in out.logprobs if lp is not None]
    if not lps or len(lps) != len(out.new_token_ids):
        return {}
    return {"logprobs": [lp.logprob for lp in lps], "top_ids": [lp.top_ids for lp in lps],
            "top_logprobs": [lp.top_logprobs for lp in lps]}


def _close_quietly(store: Any) -> None:
    """Close a store client at shutdown (its heartbeat may take seconds to end: the two
    clients are closed side by side); an error there is no longer anyone's concern."""
    with contextlib.suppress(Exception):
        store.close()


class InstanceRole:
    """One role on its host ``inst``. Every method is called by the host on the control loop
    unless it says otherwise; the defaults refuse what the role does not take."""

    kind: ClassVar[Role]
    uses_store: ClassVar[bool] = True
    """Open store clients (``--store-master``) for prefix loads and saves."""
    exposes_pool: ClassVar[bool] = False
    """Register the KV pool as a transfer segment (decode: prefills write into it)."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst

    @property
    def stage_segment(self) -> str:
        """A pipeline stage's segment for the previous stage's rows (`Hello`); '' otherwise."""
        return ""

    async def on_submit(self, ident: bytes, msg: SubmitTask) -> Message:
        """A `SubmitTask` from the connection ``ident`` (checked new, prompt valid): the
        reply; the task's events follow through the host."""
        raise Refused(ErrorCode.BAD_REQUEST, f"a {self.kind.label} instance takes no tasks")

    async def on_reserve(self, ident: bytes, msg: Reserve) -> Message:
        """A `Reserve` (decode): the reply naming the reserved blocks."""
        raise Refused(ErrorCode.BAD_REQUEST,
                      f"a {self.kind.label} instance takes no reservations")

    async def on_fetch_prefix(self, msg: FetchPrefix) -> Message:
        """Another instance asks for this one's cached prefix (the roles that prefill)."""
        raise Refused(ErrorCode.BAD_REQUEST, f"a {self.kind.label} instance serves no prefixes")

    async def on_cancel(self, request_id: str) -> bool:
        """End the request (a `Cancel`, or its connection is gone); returns whether it was
        known. Default: forget the task and abort it in the engine."""
        task = self.inst.tasks.pop(request_id, None)
        await self.inst.driver.run(lambda e: e.abort(request_id))
        return task is not None

    def on_output(self, task: Task, out: RequestOutput, step_start: float) -> None:
        """One engine output of a live ``task`` (default: stream it as events)."""
        self.inst.stream_output(task, out)

    def on_output_driver(self, engine: LLMEngine, task: Task, out: RequestOutput) -> None:
        """Driver thread, right after the step that produced ``out`` (its KV still intact)."""

    def reserved_blocks(self) -> int:
        """KV blocks held for requests whose KV has not arrived (load reports)."""
        return 0

    def sweep(self) -> None:
        """Twice a second: expire what has a deadline (decode reservations)."""

    async def close(self) -> None:
        """The host is stopping (before its driver and connector close)."""


class Instance:
    """The host of one role; see the module docstring."""

    def __init__(self, cfg: InstanceConfig, role: type[InstanceRole],
                 engine: LLMEngine | None = None) -> None:
        self.cfg = cfg
        self.kind: Role = role.kind
        self.incarnation = secrets.token_hex(8)
        tcfg = TransferConfig(host=cfg.host, advertise_host=cfg.advertise_host, metadata="p2p",
                              timeout_s=cfg.transfer_timeout_s)
        if cfg.host_id:
            tcfg = dataclasses.replace(tcfg, host_id=cfg.host_id)
        self.transfer = TransferEngine(tcfg)
        self.exposes_pool = role.exposes_pool
        storage = self._pool_storage if self.exposes_pool else None
        loading = profile_cache.starting() if engine is None else contextlib.nullcontext()
        with loading:  # no sibling's start-up profile times this load
            self.engine = engine or LLMEngine(cfg.engine, kv_storage=storage)
            self.store = self._open_store(role.uses_store)
            self.saver = self._open_store(role.uses_store) if cfg.save_to_store else None
            """The store client of saves (their thread's own: `StoreClient` is single-threaded)."""
            staging = None
            if self.store is not None or self.kind != Role.DECODE:
                seg = self.transfer.register_segment("staging", size=cfg.staging_bytes)
                staging = torch.frombuffer(seg.view, dtype=torch.uint8)
            self.connector = KVConnector(self.engine, self.store, KVConnectorConfig(
                cfg.store_block_tokens, cfg.staging_bytes,
                load_timeout_s=cfg.store_load_timeout_s), staging, saver=self.saver)
            if cfg.warmup:
                self.engine.warmup()
        # a step's bits depend on its thread count: a batch-invariant engine keeps its own
        threads = cfg.engine.threads
        lends = cfg.lend_cores and not cfg.engine.batch_invariant and \
            self.engine.device.type == "cpu"
        self.profile = startup_profile(self.engine, self.kind,
                                       lent_threads=host_cores() if lends else 0,
                                       fill_threads=host_cores()) \
            if cfg.startup_profile and not self.engine.staged else None
        """The engine's start-up profile, sent to the Conductors in `Hello` (their predictors;
        a pipeline stage has none: the Conductor predicts a group from the whole model's)."""
        if self.engine.device.type == "cpu":  # the driver thread alone runs OpenMP teams
            runtime.release_openmp_pool()
        name = cfg.instance_id or f"{cfg.role}-{os.getpid()}"  # the id is set once bound
        trace = Path(cfg.step_trace_dir) / f"{name}.steps.jsonl" if cfg.step_trace_dir else None
        # a decode or coupled step is a token interval: prefill steps keep out of its claim
        ledger = CoreLedger(threads, critical=self.kind != Role.PREFILL) if lends else None
        self.driver = EngineDriver(self.engine, self._outputs_from_driver, threads,
                                   f"engine-{cfg.role}", trace, ledger)
        self.tasks: dict[str, Task] = {}
        self.control = ControlServer(cfg, self.dispatch, self.peer_gone)
        self.local_cache = LocalCache(cfg.store_block_tokens)
        self.resync = True
        """The next load report lists the whole local cache (a Conductor subscribed)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self.control_address = ""
        self.instance_id = cfg.instance_id
        self._stopping = False
        self.load_changed = asyncio.Event()
        self._handlers: set[asyncio.Future[Any]] = set()
        self._batch: dict[bytes, list[TaskEvent]] | None = None
        """While `on_outputs` runs: the step's events per connection, sent together."""
        self.role = role(self)

    # ------------------------------------------------------------------ set-up

    def _pool_storage(self, nbytes: int) -> torch.Tensor:
        seg = self.transfer.register_segment("kv", size=nbytes)
        return torch.frombuffer(seg.view, dtype=torch.uint8)

    def _open_store(self, wanted: bool) -> Any:
        if not self.cfg.store_master or not wanted:
            return None
        from yuebing.store.client.client import StoreClient
        from yuebing.store.config import ClientConfig
        return StoreClient(ClientConfig(master=self.cfg.store_master), engine=self.transfer)

    def hello(self, seq: int = 0) -> Hello:
        e = self.engine
        return Hello(seq=seq, instance_id=self.instance_id, role=self.kind,
                     model=e.model_config.name, fingerprint=e.model_fingerprint,
                     host=self.cfg.public_host, control_address=self.control_address,
                     kv_segment=self.transfer.segment_name("kv") if self.exposes_pool else "",
                     block_size=e.block_size, store_block_tokens=self.cfg.store_block_tokens,
                     num_blocks=e.allocator.num_blocks, max_model_len=e.max_model_len,
                     incarnation=self.incarnation, engine=e.signature(), profile=self.profile,
                     layers=self.cfg.engine.layers, num_layers=e.model_config.num_layers,
                     stage_segment=self.role.stage_segment, group=self.cfg.cpp_group,
                     twin_of=self.cfg.twin_of, prefix_caching=e.config.prefix_caching)

    async def start(self) -> str:
        """Bind the control socket; returns its address."""
        self.loop = asyncio.get_running_loop()
        port = self.control.bind()
        self.control_address = f"tcp://{self.cfg.public_host}:{port}"
        if not self.instance_id:
            self.instance_id = f"{self.cfg.role}-{self.cfg.public_host}-{port}"
        log.info("%s instance %s serving control on %s (model %s, %d KV blocks)",
                 self.cfg.role, self.instance_id, self.control_address,
                 self.engine.model_config.name, self.engine.allocator.num_blocks)
        return self.control_address

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer control frames (`ControlServer.serve`), push reports and expire what has a
        deadline until ``stop`` is set."""
        reporter = asyncio.create_task(report_loop(self, stop))
        sweeper = asyncio.create_task(self._sweep_loop(stop))
        try:
            await self.control.serve(stop)
        finally:
            reporter.cancel()
            sweeper.cancel()

    async def close(self) -> None:
        self._stopping = True
        for task in list(self.tasks.values()):
            self.event(task, EventKind.ERROR, error_code=ErrorCode.SHUTTING_DOWN,
                        error="the instance is shutting down")
        try:
            await self.role.close()
        finally:
            self.driver.close()
            self.connector.close()
        await asyncio.gather(*(asyncio.to_thread(_close_quietly, c)
                               for c in (self.store, self.saver) if c is not None))
        self.control.close()  # the last events (shutdown errors) get 500 ms to go out
        self.transfer.close()

    # ------------------------------------------------------------------ control frames

    async def dispatch(self, ident: bytes, msg: Message) -> Message | None:
        """Loop thread, from `ControlServer._handle`: the reply to a decoded control request
        from the connection ``ident`` (None: none), the role's for tasks; what it raises
        (`Refused`, bad input, an engine error) goes back as an `ErrorReply`."""
        if self._stopping:
            raise Refused(ErrorCode.SHUTTING_DOWN, "the instance is shutting down")
        if isinstance(msg, Ping):
            return Ack(seq=msg.seq)
        if isinstance(msg, Subscribe):
            self.subscribers.add(ident)
            self.resync = True
            return self.hello(msg.seq)
        if isinstance(msg, Cancel):
            known = await self.role.on_cancel(msg.request_id)
            self.changed()
            if not known:
                raise Refused(ErrorCode.UNKNOWN_TASK, f"no task {msg.request_id!r} here")
            return Ack(seq=msg.seq)
        if isinstance(msg, SubmitTask):
            self._check_new(msg.request_id)
            self.check_prompt(msg.token_ids)
            reply = await self.role.on_submit(ident, msg)
            self.changed()
            return reply
        if isinstance(msg, Reserve):
            self._check_new(msg.request_id)
            reply = await self.role.on_reserve(ident, msg)
            self.changed()
            return reply
        if isinstance(msg, FetchPrefix):
            return await self.role.on_fetch_prefix(msg)
        raise Refused(ErrorCode.BAD_REQUEST, f"{type(msg).__name__} is not a control request")

    def _check_new(self, request_id: str) -> None:
        if not request_id:
            raise Refused(ErrorCode.BAD_REQUEST, "request_id must not be empty")
        if request_id in self.tasks:
            raise Refused(ErrorCode.DUPLICATE, f"request {request_id!r} is already here")

    def check_prompt(self, ids: list[int]) -> None:
        """Refuse a prompt this engine cannot take: empty, too long, or out of its vocabulary
        (`dispatch` for tasks; the decode role for reservations)."""
        vocab, limit = self.engine.model_config.vocab_size, self.engine.max_model_len
        if not ids:
            raise Refused(ErrorCode.BAD_REQUEST, "token_ids must not be empty")
        if len(ids) >= limit:
            raise Refused(ErrorCode.BAD_REQUEST, f"the prompt has {len(ids)} tokens but the "
                          f"context holds {limit}")
        if min(ids) < 0 or max(ids) >= vocab:
            raise Refused(ErrorCode.BAD_REQUEST, f"token ids must be in 0..{vocab - 1}")

    # ------------------------------------------------------------------ outputs and events

    def _outputs_from_driver(self, outputs: list[RequestOutput]) -> None:
        """Driver thread, after each step: the role's look at each output while its KV is
        intact (`InstanceRole.on_output_driver`), then `on_outputs` on the loop."""
        step_start = time.time() - self.driver.stats.last_step_s
        for out in outputs:
            task = self.tasks.get(out.request_id)
            if task is not None:
                self.role.on_output_driver(self.engine, task, out)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.on_outputs, outputs, step_start)

    def on_outputs(self, outputs: list[RequestOutput], step_start: float) -> None:
        """Loop thread: one step's outputs through the role (`InstanceRole.on_output`); their
        events leave as one `TaskEvents` frame per connection."""
        self._batch = {}
        try:
            for out in outputs:
                task = self.tasks.get(out.request_id)
                if task is not None and not task.done:
                    self.role.on_output(task, out, step_start)
        finally:
            batch, self._batch = self._batch, None
            for ident, events in batch.items():
                self.control.send(ident, events[0] if len(events) == 1
                                  else TaskEvents(events=events))

    def stream_output(self, task: Task, out: RequestOutput) -> None:
        """Send an engine output as FIRST_TOKEN/TOKENS of its choice, then FINISH when the
        request ends (a choice of several that ends earlier: ``finish_reason`` on its last
        TOKENS event, or on a token-less one)."""
        now = time.time()
        ended = out.finished and not out.done
        if out.new_token_ids:
            kind = EventKind.FIRST_TOKEN if task.outputs == 0 else EventKind.TOKENS
            task.outputs += len(out.new_token_ids)
            self.event(task, kind, token_ids=list(out.new_token_ids),
                        token_times=[now] * len(out.new_token_ids), text=out.text_delta,
                        cached_tokens=task.cached_tokens or out.num_cached_tokens,
                        prompt_tokens=out.num_prompt_tokens, index=out.index,
                        finish_reason=(out.finish_reason or "stop") if ended else None,
                        **logprob_fields(out))
        elif ended:
            self.end_choice(task, out.index, out.finish_reason or "stop", out.text_delta)
        if out.finished and out.done:
            self.finish(task, out.finish_reason or "stop", out.text_delta
                        if not out.new_token_ids else "", out.index)

    def end_choice(self, task: Task, index: int, reason: str, text: str = "") -> None:
        """Choice ``index`` of several ended with no new token: a token-less event says so."""
        self.event(task, EventKind.TOKENS, text=text, index=index, finish_reason=reason)

    def finish(self, task: Task, reason: str, text: str = "", index: int = 0) -> None:
        if reason == "error":
            self.fail(task, ErrorCode.INTERNAL, "the engine failed while running the request")
            return
        self.event(task, EventKind.FINISH, finish_reason=reason, text=text,
                    breakdown=task.breakdown, cached_tokens=task.cached_tokens,
                    prompt_tokens=len(task.token_ids), index=index)
        self._end(task)

    def spawn(self, task: Task, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` for ``task`` in the background (a reference is kept); an unexpected
        exception ends the task with an INTERNAL error event instead of leaving it hanging."""
        job = asyncio.get_running_loop().create_task(coro)
        self._handlers.add(job)

        def done(j: asyncio.Future[Any]) -> None:
            self._handlers.discard(j)
            if not j.cancelled() and j.exception() is not None and not task.done:
                log.error("%s: %s failed", task.request_id, getattr(coro, "__qualname__", coro),
                          exc_info=j.exception())
                self.fail(task, ErrorCode.INTERNAL, f"{type(j.exception()).__name__}: "
                          f"{j.exception()}")
        job.add_done_callback(done)

    def driver_then(self, task: Task, call: Callable[[LLMEngine], T],
                    then: Callable[[concurrent.futures.Future[T]], None]) -> None:
        """Queue ``call`` to the driver without awaiting it; its completion comes back as
        ``then(future)`` on the loop: one callback, no task per request (decode adoption,
        coupled/prefill add). An exception escaping ``then`` ends ``task`` with INTERNAL, as
        `spawn` does, instead of leaving it hanging until the Conductor's timeout."""
        loop = asyncio.get_running_loop()

        def guarded(fut: concurrent.futures.Future[T]) -> None:
            try:
                then(fut)
            except Exception as e:
                log.error("%s: handling a driver call failed", task.request_id, exc_info=True)
                if not task.done:
                    self.fail(task, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

        def back(fut: concurrent.futures.Future[T]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the instance stopped
                loop.call_soon_threadsafe(guarded, fut)
        self.driver.call(call).add_done_callback(back)

    def fail(self, task: Task, code: ErrorCode, error: str) -> None:
        self.event(task, EventKind.ERROR, error_code=code, error=error)
        self._end(task)

    def _end(self, task: Task) -> None:
        task.done = True
        self.tasks.pop(task.request_id, None)
        self.changed()

    def event(self, task: Task, kind: EventKind, **kw: Any) -> None:
        """An event of ``task`` to the connection that owns it (inside `on_outputs`: sent with
        the step's others)."""
        ev = TaskEvent(request_id=task.request_id, kind=kind, time_s=time.time(), **kw)
        if self._batch is not None:
            self._batch.setdefault(task.owner, []).append(ev)
        else:
            self.control.send(task.owner, ev)

    def send(self, ident: bytes, msg: Message) -> None:
        """A message to the connection ``ident`` (`ControlServer.send`; `reports`)."""
        self.control.send(ident, msg)

    @property
    def subscribers(self) -> set[bytes]:
        """The connections subscribed to load reports (`reports`, `admin`)."""
        return self.control.subscribers

    def peer_gone(self, ident: bytes) -> None:
        """Loop thread, from `ControlServer`: the connection ``ident`` closed (its Conductor
        was killed or restarted). Nobody can receive its tasks' events or cancel them any
        more, so they end now — their KV freed — instead of running for nobody."""
        orphans = [t for t in self.tasks.values() if t.owner == ident and not t.done]
        if orphans:
            log.warning("connection %s is gone: cancelling its %d task(s)", ident.hex(),
                        len(orphans))
        for task in orphans:
            self.spawn(task, self.role.on_cancel(task.request_id))
        self.changed()

    # ------------------------------------------------------------------ load reports

    def changed(self) -> None:
        """Loop thread: the load changed (task accepted or ended, blocks reserved or freed);
        a report goes out now rather than at the next period (at most every 10 ms)."""
        self.load_changed.set()

    def reserved_blocks(self) -> int:
        """KV blocks held for requests whose KV has not arrived (decode reservations)."""
        return self.role.reserved_blocks()

    def pending_tokens(self) -> int:
        """Prompt tokens accepted but not yet in the engine (loading their prefix)."""
        return sum(len(t.token_ids) for t in self.tasks.values() if t.loading)

    async def _sweep_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
            self.role.sweep()
