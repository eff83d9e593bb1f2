"""`PrefillGate`: a prefill instance's queue, kept by the Conductor, so decode KV is reserved late.

A request holds decode KV from its ``reserve`` until the decode adopts its KV; reserving at
dispatch would let a long prefill queue hold KV it cannot use yet. So each prefill instance gets
requests only while it has fewer than ``max_tokens`` uncached prompt tokens in prefill (at least
one request); the others wait here, holding only their place, in the policy's queue order
(`conductor.policy.queue`), the order the simulator keeps. A pipeline stage and its
whole-model twin share one gate (one machine), which admits one owner's work at a time. Called
by `conductor.dispatch` (`acquire`, `release`) and `conductor.cluster` (`fail`, `queued`).
Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from yuebing.conductor.policy import QueuedPrefill, QueueOrder
from yuebing.conductor.policy.queue import Fifo


@dataclass(eq=False, slots=True)
class _Waiter:
    request_id: str
    tokens: int
    item: QueuedPrefill
    fut: asyncio.Future[None]
    owner: str = ""


class PrefillGate:
    """Admission of requests into one prefill instance by uncached prompt tokens, in the queue
    order ``order`` (FIFO when none is given)."""

    def __init__(self, max_tokens: int, order: QueueOrder | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        """0: no limit (every request passes at once)."""
        self.order = order or Fifo(0.0, 1.0)
        self.clock = clock
        """The ``now`` the order is judged at (the time `QueuedPrefill.arrival_s` is on)."""
        self.inflight: dict[str, int] = {}
        self._owners: dict[str, str] = {}
        """Who each place is for: a shared gate admits one owner's requests at a time."""
        self.inflight_tokens = 0
        self._waiting: list[_Waiter] = []

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def queued(self) -> tuple[QueuedPrefill, ...]:
        """The waiting requests, in queueing order."""
        return tuple(w.item for w in self._waiting if not w.fut.done())

    def _fits(self, tokens: int, owner: str) -> bool:
        if not self.inflight:
            return True
        if any(o != owner for o in self._owners.values()):
            return False  # the machine runs the other instance's work (stage or twin)
        return not self.max_tokens or self.inflight_tokens + tokens <= self.max_tokens

    def _admit(self, request_id: str, tokens: int, owner: str) -> None:
        self.inflight[request_id] = tokens
        self._owners[request_id] = owner
        self.inflight_tokens += tokens

    async def acquire(self, request_id: str, tokens: int,
                      item: QueuedPrefill | None = None, owner: str = "") -> None:
        """Wait for ``request_id``'s turn (``item``: how the queue order sees it; none: no
        work, due now); it then counts ``tokens`` until `release`. ``owner``: the instance
        it is for, on a gate two instances of one machine share (a pipeline stage and its
        twin): requests of one owner are admitted only while no other owner's are in. Raises
        what `fail` was given if the instance dies meanwhile; a cancelled wait leaves no
        trace."""
        if request_id in self.inflight:
            raise ValueError(f"request {request_id} already holds a place")
        tokens = max(0, tokens)
        if not self._waiting and self._fits(tokens, owner):
            self._admit(request_id, tokens, owner)
            return
        if item is None:
            now = self.clock()
            item = QueuedPrefill(request_id, now, 0.0, now)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = _Waiter(request_id, tokens, item, fut, owner)
        self._waiting.append(entry)
        self._pump()  # the order may put it first, and it may fit where the head does not
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(request_id)  # admitted just as the wait was cancelled
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
                self._pump()
            raise

    def release(self, request_id: str) -> None:
        """Give ``request_id``'s place back (idempotent); the next waiters may go."""
        tokens = self.inflight.pop(request_id, None)
        if tokens is None:
            return
        self._owners.pop(request_id, None)
        self.inflight_tokens -= tokens
        self._pump()

    def fail(self, exc: BaseException, requests: Collection[str] | None = None) -> None:
        """The instance is gone: every waiter (of ``requests`` only, when given: a gate
        shared by a pipeline stage and its twin) raises ``exc``; their places are dropped."""
        gone = [w for w in self._waiting if requests is None or w.request_id in requests]
        gone_ids = {id(w) for w in gone}
        self._waiting = [w for w in self._waiting if id(w) not in gone_ids]
        for w in gone:
            if not w.fut.done():
                w.fut.set_exception(exc)
        for rid in list(self.inflight) if requests is None else requests:
            self.inflight_tokens -= self.inflight.pop(rid, 0)
            self._owners.pop(rid, None)
        self._pump()

    def _pump(self) -> None:
        while True:
            self._waiting = [w for w in self._waiting if not w.fut.done()]  # cancelled, failed
            if not self._waiting:
                return
            w = self._waiting[self.order.first([w.item for w in self._waiting], self.clock())]
            if not self._fits(w.tokens, w.owner):
                return
            self._waiting.remove(w)
            self._admit(w.request_id, w.tokens, w.owner)
            w.fut.set_result(None)
