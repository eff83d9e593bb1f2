"""The batch put of both store clients, written once with no I/O (`BatchPut`): a generator
that yields the operations it needs — a master RPC (`Call`), a transfer of writes (`Write`), a
revoke (`Revoke`) — and is sent their results; `Puts.batch_put` runs it with blocking calls
(`run`), `AsyncPuts.batch_put` with awaits (`run_async`). Every decision (codes per key, which
reservations, fallbacks, revokes, write deadlines) is made here, so the two clients cannot drift.

Life of a batch (`ClientConfig.reserve_ahead`, items of one shape, at most `rv.MAX_PER_SHAPE`):
with as many usable reservations of the shape held, write every item into one of them (one
transfer batch, by the earliest reservation's write deadline) and send one ``batch_put_commit``,
which commits each item (a code per item) and hands out the next batch's; a failed write revokes
those reservations (and held ones on the failed segments), a refused commit or a refused item
falls back. Otherwise — or for what fell back — two phases: one ``batch_put_start`` (placement
of all items, plus ``reserve_next`` = n reservations from the shape's second batch on), one
transfer batch of all writes by the start's write deadline, a revoke of the items whose write
failed (naming the blamed segments), one ``batch_put_end`` of the others. Items whose write failed
are put again, up to ``put_retries`` times.

Concurrency: the sync client runs one batch at a time and `take_many`s reservations. Concurrent
coroutines of one asyncio client (``claim=True``) `claim_many` them instead, synchronously (no
await between taking them and marking them busy), so each reservation is written by exactly one
batch or put, and no reply still in flight hands a claimed one out again (`reserve`). A claimed
reservation whose commit was refused — the whole commit, or its item (the key exists, say) —
holds nothing and stays the master's: it is `release`d before the reply's reservations are kept,
so it may be held again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from yuebing.core.errors import InputError, StoreError
from yuebing.store import messages as m
from yuebing.store.client import common as cm
from yuebing.store.client import reserve as rv
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferRequest, TransferStatus

log = logging.getLogger(__name__)
C = m.Code


@dataclass(frozen=True, slots=True)
class Call:
    """Send ``msg`` to the master; the reply is sent back, a `StoreError` thrown in."""

    msg: m.Message


@dataclass(frozen=True, slots=True)
class Write:
    """Transfer the writes ``reqs`` by the monotonic ``deadline``; sent back: the
    `BatchStatus`, or the `TransferError`/`InputError` the transfer raised (not thrown)."""

    reqs: list[TransferRequest]
    deadline: float


@dataclass(frozen=True, slots=True)
class Revoke:
    """``batch_put_revoke`` of ``keys`` naming ``failed`` segments, giving back the held
    reservations ``unused`` (never written: freed at once); the runner logs a failure (the
    master then reclaims them at their write expiry) and sends back None."""

    keys: list[str]
    failed: list[str]
    unused: list[str] = field(default_factory=list)


Op = Call | Write | Revoke
Steps = Generator[Op, Any, list[int]]


def items_of(cfg: ClientConfig, keys: Sequence[str], values: Sequence[object],
             replicas: int | None, strategy: str | None, preferred: Sequence[str] | None,
             hard_pin: bool, soft_pin_s: float) -> tuple[list[m.PutItem], list[memoryview]]:
    """The `PutItem`s and read-only views of a batch put's ``keys`` and ``values``
    (`InputError` on a count mismatch, a bad key or an empty value: nothing is sent then)."""
    if len(keys) != len(values):
        raise InputError(f"{len(keys)} keys but {len(values)} values")
    mvs = [cm.view(v, writable=False) for v in values]
    items = [cm.put_item(cfg, k, mv, replicas, strategy, preferred, hard_pin, soft_pin_s)
             for k, mv in zip(keys, mvs, strict=True)]
    return items, mvs


class BatchPut:
    """One batch put of a client (`steps` is the generator; see the module docstring)."""

    def __init__(self, cfg: ClientConfig, client: str, resv: rv.HeldReservations,
                 items: list[m.PutItem], mvs: list[memoryview], claim: bool) -> None:
        self.cfg, self.client, self.resv, self.claim = cfg, client, resv, claim
        self.items, self.mvs = items, mvs
        self.codes = [int(C.INTERNAL)] * len(items)
        """A `Code` per item: what the caller gets back."""

    def steps(self) -> Steps:
        """The whole batch put; returns a `Code` per item."""
        todo = list(range(len(self.items)))
        for _ in range(self.cfg.put_retries + 1):
            if not todo:
                break
            todo = yield from self._once(todo)
        return self.codes

    def _shape(self, todo: list[int]) -> rv.Shape | None:
        """The shape of the items ``todo`` when they may go through reservations."""
        first = rv.shape_of(self.items[todo[0]])
        return first if self.cfg.reserve_ahead and len(todo) <= rv.MAX_PER_SHAPE and all(
            rv.shape_of(self.items[i]) == first for i in todo[1:]) else None

    def _once(self, todo: list[int]) -> Generator[Op, Any, list[int]]:
        """One attempt for the items ``todo``; fills ``codes``, returns those to retry. Items
        of one shape go through held reservations when there are enough (`_reserved`) and ask
        for the next batch's; the rest are put in two phases."""
        items, codes = self.items, self.codes
        shape = self._shape(todo)
        if shape is not None:
            todo = yield from self._reserved(todo, shape)
            if not todo:
                return []
        sent = time.monotonic()
        reserve_next = len(todo) if shape is not None and self.resv.want(shape) else 0
        r = yield Call(m.BatchPutStart(client=self.client, items=[items[i] for i in todo],
                                       reserve_next=reserve_next))
        assert isinstance(r, m.BatchPutTargets)
        if shape is not None:
            self.resv.keep_many(shape, r.reservations, sent)
        reqs, owner = [], []
        for i, code, reps in zip(todo, r.codes, r.replicas, strict=True):
            codes[i] = code
            if code == C.OK:
                for req in cm.writes(self.mvs[i], reps):
                    reqs.append(req)
                    owner.append(i)
        failed: set[int] = set()
        bad: list[str] = []
        if reqs:
            got = yield Write(reqs, cm.write_deadline(sent, r.expires_in_s))
            if isinstance(got, BatchStatus):
                failed = {owner[j] for j, rs in enumerate(got.requests)
                          if rs.status != TransferStatus.DONE}
                bad = cm.blamed_segments(reqs, got.requests)
            else:
                log.warning("batch put transfer failed: %s", got)
                failed, bad = set(owner), cm.blamed_segments(reqs, None, got)
        ok = [i for i in todo if codes[i] == C.OK and i not in failed]
        if failed:
            yield Revoke([items[i].key for i in sorted(failed)], bad)
            for i in failed:
                codes[i] = int(C.INTERNAL)
        if ok:
            ends = yield Call(m.BatchPutEnd(client=self.client, keys=[items[i].key for i in ok]))
            for i, c in zip(ok, ends.codes, strict=True):
                codes[i] = c
        return sorted(failed)

    def _take(self, shape: rv.Shape, n: int) -> tuple[list[rv.Held], list[str]]:
        """``n`` held reservations of ``shape`` for this batch alone (or none) and the keys
        of stale ones to revoke now (`take_many`, or `claim_many` for concurrent batches)."""
        now = time.monotonic()
        take = self.resv.claim_many if self.claim else self.resv.take_many
        held, stale = take(shape, n, now)
        return held, [h.key for h in stale if h.deadline > now]  # past it, the master did

    def _reserved(self, todo: list[int], shape: rv.Shape) -> Generator[Op, Any, list[int]]:
        """Put the items ``todo`` (one shape) through as many held reservations: one write, one
        ``batch_put_commit`` (which brings the next batch's). Fills ``codes`` of the items it
        stored (or found existing); returns the items left to the two-phase way — all of them
        when too few reservations are held or the write or commit failed."""
        held, stale = self._take(shape, len(todo))
        if stale:  # give back what the master holds: never written, freed at once
            yield Revoke([], [], stale)
        if not held:
            return todo
        reqs = [req for i, h in zip(todo, held, strict=True)
                for req in cm.writes(self.mvs[i], h.replicas)]
        got = yield Write(reqs, min(h.deadline for h in held))
        failed, bad, why = cm.write_outcome(reqs, got)
        if failed:
            yield Revoke([h.key for h in held], bad, self.resv.touching(failed))
            log.warning("batch put: write into reservations on %s failed: %s", failed, why)
            return todo
        sent = time.monotonic()
        try:
            r = yield Call(m.BatchPutCommit(
                client=self.client, reservations=[h.key for h in held],
                items=[self.items[i] for i in todo], reserve_next=len(todo)))
        except StoreRpcError as e:
            self._release(held)
            log.info("batch put: reservations refused (%s); putting it in two phases", e)
            return todo
        assert isinstance(r, m.BatchPutCommitted)
        self._release([h for h, code in zip(held, r.codes, strict=True) if code != C.OK])
        self.resv.keep_many(shape, r.reservations, sent)
        left = []
        for i, code in zip(todo, r.codes, strict=True):
            if code in (C.OK, C.EXISTS):
                self.codes[i] = code
            else:  # its reservation refused it (and stays the master's): two phases
                left.append(i)
        return left

    def _release(self, held: list[rv.Held]) -> None:
        """Claimed reservations nothing was committed into (they stay the master's)."""
        if self.claim:
            for h in held:
                self.resv.release(h.key)


def run(steps: Steps, do: Callable[[Op], Any]) -> list[int]:
    """Run ``steps`` with the blocking ``do`` (the sync client's RPC, transfer and revoke)."""
    reply: Any = None
    error: StoreError | None = None
    while True:
        try:
            op = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        reply, error = None, None
        try:
            reply = do(op)
        except StoreError as e:  # the master's refusal (or a lost master): the steps decide
            error = e


async def run_async(steps: Steps, do: Callable[[Op], Awaitable[Any]]) -> list[int]:
    """`run` with the asyncio client's awaitable ``do``."""
    reply: Any = None
    error: StoreError | None = None
    while True:
        try:
            op = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        reply, error = None, None
        try:
            reply = await do(op)
        except StoreError as e:
            error = e
