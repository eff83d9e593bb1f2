"""Load reports of an instance: the local prefix cache's store keys and the report loop.

`LocalCache` (driver thread) follows which store blocks' KV sits in this engine's prefix cache:
`note` after a prefill, `check_evicted` before each report, `take` for the report's
``cache_added``/``cache_removed`` (or the full list on a resync). `report_loop` (control loop)
sends `LoadReport`s to every subscribed Conductor at ``report_hz`` and whenever its host says
its load changed; the host (`base.Instance`, started from its ``serve``) is a `ReportHost`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from typing import Protocol

import msgspec

from yuebing.core.ids import BlockHash
from yuebing.engine.engine import LLMEngine
from yuebing.instance.config import InstanceConfig
from yuebing.instance.driver import EngineDriver
from yuebing.instance.kvkeys import store_block_keys
from yuebing.protocol import Message
from yuebing.protocol.instance import LoadReport


class LocalCache:
    """Store-block keys whose KV is in the engine's prefix cache (driver thread only)."""

    def __init__(self, store_block_tokens: int) -> None:
        self.store_block_tokens = store_block_tokens
        self.keys: OrderedDict[BlockHash, BlockHash] = OrderedDict()
        """Store-block key → the engine key of the store block's last engine block (its
        eviction from the prefix cache means the store block is gone here)."""
        self._added: list[int] = []
        self._removed: list[int] = []

    def note(self, engine: LLMEngine, token_ids: list[int]) -> None:
        """The prompt's full store blocks are in the local prefix cache now."""
        sbt = self.store_block_tokens
        keys = store_block_keys(token_ids, sbt, engine.fingerprint)
        if not keys:
            return
        ekeys = engine.block_keys(token_ids[:len(keys) * sbt])
        per = sbt // engine.block_size
        for i, k in enumerate(keys):
            if k not in self.keys:
                self._added.append(int(k))
            self.keys[k] = ekeys[(i + 1) * per - 1]
            self.keys.move_to_end(k)

    def check_evicted(self, engine: LLMEngine) -> None:
        """Drop store keys whose last engine block left the prefix cache."""
        gone = [k for k, ek in self.keys.items() if not engine.allocator.is_cached(ek)]
        for k in gone:
            del self.keys[k]
            self._removed.append(int(k))

    def take(self, resync: bool) -> tuple[list[int], list[int]]:
        """(added, removed) since the last call; on ``resync`` every key held, none removed."""
        added = [int(k) for k in self.keys] if resync else self._added
        removed = [] if resync else self._removed
        self._added, self._removed = [], []
        return added, removed


class ReportHost(Protocol):
    """What the report loop reads of the instance it reports for."""

    cfg: InstanceConfig
    instance_id: str
    incarnation: str
    local_cache: LocalCache
    driver: EngineDriver
    resync: bool
    """The next report lists every cached key (a new subscriber, a gap)."""
    load_changed: asyncio.Event

    @property
    def subscribers(self) -> set[bytes]: ...

    def send(self, ident: bytes, msg: Message) -> None: ...

    def reserved_blocks(self) -> int: ...

    def pending_tokens(self) -> int: ...


def measure(inst: ReportHost, engine: LLMEngine, resync: bool) -> LoadReport:
    """Driver thread: the engine's side of a load report (the control loop adds what the
    instance's tasks hold: reserved blocks, prompts still loading their prefix)."""
    inst.local_cache.check_evicted(engine)
    sched, alloc = engine.scheduler, engine.allocator
    queued = [s for s in (*sched.waiting, *sched.running) if s.is_prefilling]
    added, removed = inst.local_cache.take(resync)
    stats = inst.driver.stats
    return LoadReport(
        instance_id=inst.instance_id, incarnation=inst.incarnation,
        report_seq=0, time_s=time.time(),
        queued_prefill_tokens=sum(s.num_pending for s in queued),
        queued_requests=len(queued), running=len(sched.running),
        waiting=len(sched.waiting), context_tokens=sum(s.num_tokens for s in sched.running),
        free_blocks=alloc.num_free, total_blocks=alloc.num_blocks, reserved_blocks=0,
        prefill_tokens_per_s=stats.prefill_tokens_per_s, decode_step_s=stats.decode_step_s,
        preemptions=sched.num_preemptions, step_threads=inst.driver.step_threads(),
        cache_added=added, cache_removed=removed,
        cache_full_resync=resync)


def _read_exception(fut: asyncio.Future[LoadReport]) -> None:
    """Marks a measurement's exception read: one still queued when the instance stops fails
    with `DriverStopped` after this loop was cancelled, and asyncio would log it as unread."""
    if not fut.cancelled():
        fut.exception()


async def report_loop(inst: ReportHost, stop: asyncio.Event) -> None:
    """Reports at ``report_hz`` and on change. The load is measured in the driver thread
    between steps; while a long step runs, the last measurement goes out again as a
    heartbeat (fresh time and sequence, no cache changes), so a busy instance never looks
    dead to the Conductor. Reports are numbered here, in send order (the Conductor resyncs
    its view of the local cache on a gap)."""
    period = 1.0 / inst.cfg.report_hz
    pending: asyncio.Future[LoadReport] | None = None
    last: LoadReport | None = None
    seq = 0
    while not stop.is_set():
        inst.load_changed.clear()
        if inst.subscribers:
            if pending is None:
                resync, inst.resync = inst.resync, False
                pending = asyncio.ensure_future(inst.driver.run(
                    lambda e, r=resync: measure(inst, e, r)))  # type: ignore[misc]
                pending.add_done_callback(_read_exception)  # one left at the stop goes unread
            await asyncio.wait({pending}, timeout=period)
            report: LoadReport | None = None
            if pending.done():
                with contextlib.suppress(RuntimeError):
                    measured = pending.result()
                    report = last = msgspec.structs.replace(
                        measured, reserved_blocks=inst.reserved_blocks(),
                        queued_prefill_tokens=measured.queued_prefill_tokens +
                        inst.pending_tokens())
                pending = None
            elif last is not None:
                report = msgspec.structs.replace(
                    last, time_s=time.time(), cache_added=[], cache_removed=[],
                    cache_full_resync=False, reserved_blocks=inst.reserved_blocks())
            if report is not None:
                seq += 1
                report = msgspec.structs.replace(report, report_seq=seq)
                for ident in list(inst.subscribers):
                    inst.send(ident, report)
        waits = {asyncio.ensure_future(stop.wait()),
                 asyncio.ensure_future(inst.load_changed.wait())}
        _, idle = await asyncio.wait(waits, timeout=period,
                                     return_when=asyncio.FIRST_COMPLETED)
        for w in idle:
            w.cancel()
        await asyncio.sleep(0.01)
