"""`PrefillGate`: a prefill instance's queue, kept by the Conductor, so decode KV is reserved late.

A request holds decode KV from its ``reserve`` until the decode adopts its KV; reserving at
dispatch would let a long prefill queue hold KV it cannot use yet. So each prefill instance gets
requests only while it has fewer than ``max_tokens`` uncached prompt tokens in prefill (at least
one request); the others wait here, holding only their place, in the policy's queue order
(`conductor.policy.queue`), the order the simulator keeps. Called by `conductor.dispatch`
(`acquire`, `release`) and `conductor.cluster` (`fail`, `queued`). Event-loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.conductor.policy import QueuedPrefill, QueueOrder
from yuebing.conductor.policy.queue import Fifo


@dataclass(eq=False, slots=True)
class _Waiter:
    request_id: str
    tokens: int
    item: QueuedPrefill
    fut: asyncio.Future[None]


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
        self.inflight_tokens = 0
        self._waiting: list[_Waiter] = []

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def queued(self) -> tuple[QueuedPrefill, ...]:
        """The waiting requests, in queueing order."""
        return tuple(w.item for w in self._waiting if not w.fut.done())

    def _fits(self, tokens: int) -> bool:
        return (not self.max_tokens or not self.inflight
                or self.inflight_tokens + tokens <= self.max_tokens)

    def _admit(self, request_id: str, tokens: int) -> None:
        self.inflight[request_id] = tokens
        self.inflight_tokens += tokens

    async def acquire(self, request_id: str, tokens: int,
                      item: QueuedPrefill | None = None) -> None:
        """Wait for ``request_id``'s turn (``item``: how the queue order sees it; none: no
        work, due now); it then counts ``tokens`` until `release`. Raises what `fail` was
        given if the instance dies meanwhile; a cancelled wait leaves no trace."""
        if request_id in self.inflight:
            raise ValueError(f"request {request_id} already holds a place")
        tokens = max(0, tokens)
        if not self._waiting and self._fits(tokens):
            self._admit(request_id, tokens)
            return
        if item is None:
            now = self.clock()
            item = QueuedPrefill(request_id, now, 0.0, now)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = _Waiter(request_id, tokens, item, fut)
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
        self.inflight_tokens -= tokens
        self._pump()

    def fail(self, exc: BaseException) -> None:
        """The instance is gone: every waiter raises ``exc``; places held are dropped."""
        waiting, self._waiting = self._waiting, []
        for w in waiting:
            if not w.fut.done():
                w.fut.set_exception(exc)
        self.inflight.clear()
        self.inflight_tokens = 0

    def _pump(self) -> None:
        while True:
            self._waiting = [w for w in self._waiting if not w.fut.done()]  # cancelled, failed
            if not self._waiting:
                return
            w = self._waiting[self.order.first([w.item for w in self._waiting], self.clock())]
            if not self._fits(w.tokens):
                return
            self._waiting.remove(w)
            self._admit(w.request_id, w.tokens)
            w.fut.set_result(None)
