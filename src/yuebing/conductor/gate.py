"""`PrefillGate`: a prefill instance's queue, kept by the Conductor, so decode KV is reserved late.

A disaggregated request holds decode KV from its ``reserve`` until the decode adopts its KV.
Reserving at dispatch would let a long prefill queue hold decode KV it cannot use yet (new
requests refused while the decode idles). So the dispatcher gives each prefill instance its
requests in arrival order, only while the instance has fewer than ``max_tokens`` uncached
prompt tokens in prefill (always at least one request); a request waits here holding nothing
but its place, then reserves its decode blocks and is submitted. Its place is given back at its
first token, when it fails or when it is cancelled.

Called by `yuebing.conductor.dispatch.Dispatcher` (`acquire`, `release`) and by
`yuebing.conductor.cluster.LiveCluster` (`fail` when the instance dies). The waiting requests
are already in the instance's load in the policy's view (`LiveCluster.routed`), so the TTFT
estimate includes the time they wait here. Event-loop only; not thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class PrefillGate:
    """FIFO admission of requests into one prefill instance by uncached prompt tokens."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        """0: no limit (every request passes at once)."""
        self.inflight: dict[str, int] = {}
        self.inflight_tokens = 0
        self._waiting: deque[tuple[str, int, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _fits(self, tokens: int) -> bool:
        return (not self.max_tokens or not self.inflight
                or self.inflight_tokens + tokens <= self.max_tokens)

    def _admit(self, request_id: str, tokens: int) -> None:
        self.inflight[request_id] = tokens
        self.inflight_tokens += tokens

    async def acquire(self, request_id: str, tokens: int) -> None:
        """Wait for ``request_id``'s turn; it then counts ``tokens`` until `release`. Raises
        what `fail` was given if the instance dies meanwhile; a cancelled wait leaves no trace."""
        if request_id in self.inflight:
            raise ValueError(f"request {request_id} already holds a place")
        tokens = max(0, tokens)
        if not self._waiting and self._fits(tokens):
            self._admit(request_id, tokens)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (request_id, tokens, fut)
        self._waiting.append(entry)
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
        waiting, self._waiting = self._waiting, deque()
        for _, _, fut in waiting:
            if not fut.done():
                fut.set_exception(exc)
        self.inflight.clear()
        self.inflight_tokens = 0

    def _pump(self) -> None:
        while self._waiting:
            rid, tokens, fut = self._waiting[0]
            if fut.done():  # cancelled, or failed
                self._waiting.popleft()
                continue
            if not self._fits(tokens):
                return
            self._waiting.popleft()
            self._admit(rid, tokens)
            fut.set_result(None)
