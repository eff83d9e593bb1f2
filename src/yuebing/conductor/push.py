"""The relay's fast path: token deltas written into their HTTP response by the instance client's
reader, with no queue, task wake-up or generator chain per token. Used by `conductor.server`
(`SseResponse`, `Pusher`) and `conductor.dispatch` (`token_sink`).

The reader (`InstanceClient`) hands a plain TOKENS event to the request's sink (installed by
`Dispatcher._relay` once the first token is out), which renders the chunk and drives the
response's ASGI ``send`` right there. Everything else (first token, FINISH, errors, the timer,
an event behind queued ones) takes the queue path, so order and rules are the same.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Send

from yuebing.conductor.delta import Delta, delta
from yuebing.conductor.stats import RequestStats
from yuebing.protocol.instance import EventKind, TaskEvent

log = logging.getLogger(__name__)


class Pusher:
    """Writes one streamed response's token chunks from outside its task.

    The response's own generator (`yuebing.conductor.server`) sets ``waiting`` while it waits
    for its next delta; `ready` is true only then, once the response has started and no pushed
    send is still pending, so a pushed chunk never overtakes one the generator yields.

    Through the queue path each event costs a queue put, a task wake-up, six async generators
    and Starlette's send loop, and the last stream of a 50-stream frame waits for the 49 before it.
    For a body chunk uvicorn's ``send`` writes to the transport and returns without suspending
    unless the client stopped reading; then the rest of that send finishes in a task (`_resume`)
    that the response's own next write waits for (`hold`)."""

    __slots__ = ("send", "waiting", "pending", "failed", "render", "_observe")

    def __init__(self, render: Callable[[Delta], bytes], observe: Callable[[float], None]) -> None:
        self.send: Send | None = None
        self.waiting = False
        self.pending: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None
        self.render = render
        """A delta's chunk (the response's own writes use it too)."""
        self._observe = observe

    def ready(self) -> bool:
        return self.waiting and self.send is not None and self.pending is None \
            and self.failed is None

    def push(self, d: Delta) -> None:
        """Render ``d`` and write it now (call only when `ready`)."""
        assert self.send is not None
        try:
            coro = self.send({"type": "http.response.body", "body": self.render(d),
                              "more_body": True})
            if not isinstance(coro, Coroutine):  # not steppable by hand: a task sends it
                self._hold(asyncio.ensure_future(coro), d.received_s)
                return
            blocker = coro.send(None)
        except StopIteration:
            self._observe(time.perf_counter() - d.received_s)
            return
        except Exception as e:  # the response's own next write raises it (`hold`)
            log.debug("pushed send failed: %s", e)
            self.failed = e
            return
        self._hold(asyncio.ensure_future(_resume(coro, blocker)), d.received_s)

    def _hold(self, task: asyncio.Task[Any], received_s: float) -> None:
        """A send held up by flow control: the fast path pauses until it is done (counted
        in the relay histogram then); its error is kept for `hold`."""
        self.pending = task

        def done(t: asyncio.Task[Any]) -> None:
            if self.pending is t:
                self.pending = None
            if t.cancelled():
                return
            if t.exception() is not None:
                self.failed = t.exception()
            else:
                self._observe(time.perf_counter() - received_s)
        task.add_done_callback(done)

    def close(self) -> None:
        """The response ended: a send still held is dropped."""
        self.waiting = False
        if self.pending is not None:
            self.pending.cancel()

    async def hold(self) -> None:
        """Before the response's generator writes: pushing stops (until it sets ``waiting``
        again) and a pushed send held up by flow control has finished (its error, if any, is
        raised here)."""
        self.waiting = False
        if self.pending is not None:
            await asyncio.wait({self.pending})
        if self.failed is not None:
            raise self.failed


def token_sink(out: Pusher, stats: RequestStats) -> Callable[[TaskEvent, float], bool]:
    """A request's fast path, for `InstanceClient.divert`: a plain TOKENS event goes to
    ``out`` at once while it is ready; anything else (FINISH, ERROR, a breakdown, the response
    busy) returns False and is queued for `yuebing.conductor.dispatch.Dispatcher._relay`."""
    def sink(ev: TaskEvent, received: float) -> bool:
        if ev.kind != EventKind.TOKENS or ev.breakdown is not None or ev.finish_reason \
                or not out.ready():
            return False
        out.push(delta(ev, stats, received))
        return True
    return sink


async def _resume(coro: Coroutine[Any, Any, Any], blocker: Any) -> None:
    """Drive ``coro`` — suspended on the future ``blocker`` when it was stepped by hand —
    to its end, as a task would."""
    try:
        while True:
            if isinstance(blocker, asyncio.Future):
                blocker._asyncio_future_blocking = False  # taken, as a task takes it
            try:
                await blocker
            except asyncio.CancelledError:
                if not isinstance(blocker, asyncio.Future) or not blocker.cancelled():
                    raise  # this task was cancelled, not the future it waited on
            except Exception:  # the coroutine reads the future's outcome itself
                pass
            blocker = coro.send(None)
    except StopIteration:
        return
    finally:
        coro.close()


class SseResponse(StreamingResponse):
    """A `StreamingResponse` whose ``send`` its `Pusher` may use between two chunks of its
    body iterator."""

    def __init__(self, content: Any, pusher: Pusher, **kw: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kw)
        self.pusher = pusher

    async def stream_response(self, send: Send) -> None:
        self.pusher.send = send
        try:
            await super().stream_response(send)
        finally:
            self.pusher.send = None
