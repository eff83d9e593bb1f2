"""`InstanceClient`: the Conductor's asyncio connection to one instance's control server.

One zmq DEALER per instance. Calls (`subscribe`, `submit`, `reserve`, `cancel`, `ping`,
`fetch_prefix`) send a request with a fresh ``seq`` and await the reply with that ``seq`` (an
`ErrorReply` raises `InstanceError`, silence `InstanceUnavailable`). A reader task routes pushed
messages: `LoadReport`s to ``on_report``, `TaskEvent`s to their request's queue (made before the
request is sent, so no event is lost). Used by `yuebing.conductor`, `yuebing bench instance`,
peer instances (`instance.prefix`) and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from yuebing.core.auth import env_cluster_token
from yuebing.core.errors import YuebingError
from yuebing.ops.zap import dial_plain
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol.instance import (
    Ack,
    Cancel,
    ErrorCode,
    ErrorReply,
    EventKind,
    Fetched,
    FetchPrefix,
    Hello,
    LoadReport,
    Ping,
    Reserve,
    Reserved,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskEvent,
    TaskEvents,
)

log = logging.getLogger(__name__)


class InstanceError(YuebingError):
    """The instance refused a request (``code`` says why)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


MAX_ABANDONED = 4096
"""Reservations given up on that are remembered (the oldest are forgotten first)."""


class InstanceUnavailable(YuebingError):
    """No reply from the instance in time (dead, hung or unreachable)."""


class InstanceClient:
    """Asyncio client of one instance (create inside the event loop that uses it).

    A socket monitor watches the connection: when an established one drops (the instance was
    killed, or restarted at the same address) every open stream and call fails at once — the
    DEALER's next connection is a new peer to the instance, which cannot route their events
    here. ``on_link(False)`` is called and its owner fails them (`fail_all`: the Conductor marks
    the instance dead); without ``on_link``, or if it raised, the client fails them itself.
    `fail_all` ends each stream once. ``on_link(True)``: a connection is up again (no
    subscription there yet). With a cluster token (``token``, default
    ``$YUEBING_CLUSTER_TOKEN``) the DEALER presents it; a mismatch never answers (calls time
    out)."""

    def __init__(self, address: str, timeout_s: float = 5.0,
                 on_report: Callable[[LoadReport], None] | None = None,
                 ctx: zmq.asyncio.Context | None = None, token: str | None = None,
                 on_link: Callable[[bool], None] | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.on_report = on_report
        self.on_link = on_link
        self.hello: Hello | None = None
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        token = env_cluster_token() if token is None else token
        if token:
            dial_plain(self._sock, token)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(address)
        self._seq = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Message]] = {}
        self._abandoned: OrderedDict[int, str] = OrderedDict()
        """seq → request id of reservations whose caller gave up waiting (timeout or
        cancel): a `Reserved` that still comes is cancelled at once (`_dispatch`)."""
        self._events: dict[str, asyncio.Queue[tuple[TaskEvent, float]]] = {}
        self._sinks: dict[str, Callable[[TaskEvent, float], bool]] = {}
        self._ended: set[str] = set()
        """Request ids of open streams that `fail_all` ended (it ends each once)."""
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch_link())
        self.closed = False

    # ------------------------------------------------------------------ calls

    async def _call(self, make: Callable[[int], Message], expect: type[Message],
                    timeout_s: float | None = None, reserving: str = "") -> Message:
        if self.closed:
            raise InstanceUnavailable(f"client of {self.address} is closed")
        seq = next(self._seq)
        fut: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        async def exchange() -> Message:
            # the send counts against the timeout too: a DEALER with no peer (a refused
            # handshake, a wrong cluster token) blocks its send
            await self._sock.send(encode(make(seq)))
            return await fut
        try:
            reply = await asyncio.wait_for(exchange(), timeout_s or self.timeout_s)
        except BaseException as e:
            if reserving:  # the instance may still reserve (it was stopped, or slow)
                self._abandoned[seq] = reserving
                while len(self._abandoned) > MAX_ABANDONED:
                    self._abandoned.popitem(last=False)
            if isinstance(e, TimeoutError):
                raise InstanceUnavailable(f"instance at {self.address} did not answer in "
                                          f"{timeout_s or self.timeout_s:.1f} s") from None
            raise
        finally:
            self._pending.pop(seq, None)
        if isinstance(reply, ErrorReply):
            raise InstanceError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise InstanceError(ErrorCode.INTERNAL,
                                f"expected {expect.__name__}, got {type(reply).__name__}")
        return reply

    async def subscribe(self, conductor: str = "") -> Hello:
        """Start receiving load reports and learn who the instance is."""
        hello = await self._call(lambda s: Subscribe(seq=s, conductor=conductor), Hello)
        assert isinstance(hello, Hello)
        self.hello = hello
        return hello

    async def ping(self, timeout_s: float | None = None) -> None:
        await self._call(lambda s: Ping(seq=s), Ack, timeout_s)

    async def submit(self, task: SubmitTask) -> None:
        """Queue a task; its events arrive on `events(task.request_id)`."""
        self._open_events(task.request_id)
        try:
            await self._call(lambda s: _with_seq(task, s), Ack)
        except BaseException:
            self._events.pop(task.request_id, None)
            raise

    async def reserve(self, request_id: str, token_ids: list[int], sampling: Sampling,
                      timeout_s: float = 120.0) -> Reserved:
        """Decode side: hold KV blocks for the prompt; its events arrive on `events`."""
        self._open_events(request_id)
        try:
            r = await self._call(lambda s: Reserve(
                seq=s, request_id=request_id, prompt_tokens=len(token_ids), sampling=sampling,
                token_ids=list(token_ids), timeout_s=timeout_s), Reserved,
                reserving=request_id)
        except BaseException:
            self._events.pop(request_id, None)
            raise
        assert isinstance(r, Reserved)
        return r

    async def cancel(self, request_id: str) -> bool:
        """Cancel a task or reservation; False when the instance did not know it."""
        self._events.pop(request_id, None)
        try:
            await self._call(lambda s: Cancel(seq=s, request_id=request_id), Ack)
        except InstanceError as e:
            if e.code == ErrorCode.UNKNOWN_TASK:
                return False
            raise
        return True

    async def fetch_prefix(self, msg: FetchPrefix, timeout_s: float | None = None) -> int:
        r = await self._call(lambda s: _with_seq(msg, s), Fetched, timeout_s)
        assert isinstance(r, Fetched)
        return r.blocks

    # ------------------------------------------------------------------ events

    def _open_events(self, request_id: str) -> None:
        if request_id in self._events:
            raise InstanceError(ErrorCode.DUPLICATE, f"request {request_id!r} is in flight")
        self._events[request_id] = asyncio.Queue()
        self._ended.discard(request_id)

    async def events(self, request_id: str) -> AsyncIterator[TaskEvent]:
        """The task's events up to and including FINISH or ERROR."""
        async for ev, _ in self.timed_events(request_id):
            yield ev

    async def timed_events(self, request_id: str) -> AsyncIterator[tuple[TaskEvent, float]]:
        """`events` with each one's arrival (``time.perf_counter()`` when its frame was read
        from the socket: the Conductor's relay latency starts there)."""
        q = self._events.get(request_id)
        if q is None:
            raise InstanceError(ErrorCode.UNKNOWN_TASK, f"no task {request_id!r} here")
        try:
            while True:
                item = await q.get()
                yield item
                if item[0].kind >= EventKind.FINISH:
                    return
        finally:
            self._events.pop(request_id, None)
            self._sinks.pop(request_id, None)

    def divert(self, request_id: str,
               sink: Callable[[TaskEvent, float], bool] | None) -> None:
        """Offer the request's events to ``sink`` (None: stop) before its queue: the reader
        calls ``sink(event, arrived)`` while the queue is empty, and queues the event only
        when it returns False (the Conductor's fast path, `yuebing.conductor.push`)."""
        if sink is None:
            self._sinks.pop(request_id, None)
        elif request_id in self._events:
            self._sinks[request_id] = sink

    def interrupt(self, request_id: str, marker: TaskEvent) -> None:
        """Put ``marker`` (an ERROR event the caller recognises by identity, e.g. its request
        ran out of time) at the end of the request's event stream, ending it there."""
        q = self._events.get(request_id)
        if q is not None:
            q.put_nowait((marker, time.perf_counter()))

    def fail_all(self, reason: str) -> None:
        """End every open event stream with an ERROR (once: not one ended by an earlier
        call) and fail every call still waiting for its reply with `InstanceUnavailable`
        (the instance is gone)."""
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(InstanceUnavailable(reason))
        now = time.perf_counter()
        self._ended.intersection_update(self._events)  # forget streams closed since
        for rid, q in list(self._events.items()):
            if rid in self._ended:
                continue
            self._ended.add(rid)
            q.put_nowait((TaskEvent(request_id=rid, kind=EventKind.ERROR,
                                    error_code=ErrorCode.INTERNAL, error=reason), now))

    # ------------------------------------------------------------------ reader

    async def _read(self) -> None:
        # frames already queued are drained through a synchronous shadow of the socket: the
        # asyncio socket costs a future and an EVENTS poll per frame (the Conductor's hot path)
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        while True:
            try:
                frame = await self._sock.recv()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            arrived = time.perf_counter()
            while True:
                try:
                    msg = decode(frame)
                except ProtocolError as e:
                    log.warning("bad frame from %s: %s", self.address, e)
                else:
                    self._dispatch(msg, arrived)
                try:
                    frame = sync.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return

    async def _watch_link(self) -> None:
        up = ever = False
        while True:
            try:
                event = parse_monitor_message(await self._monitor.recv_multipart())["event"]
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not up:
                up, again, ever = True, ever, True
                if again:
                    self._link(True)
            elif event == zmq.EVENT_DISCONNECTED and up:
                up = False
                reason = f"the connection to the instance at {self.address} was lost"
                log.info("%s", reason)
                if not self._link(False):  # no owner ended the streams: end them here
                    self.fail_all(reason)

    def _event(self, ev: TaskEvent, arrived: float) -> None:
        q = self._events.get(ev.request_id)
        if q is None:
            return
        if q.empty():
            sink = self._sinks.get(ev.request_id)
            if sink is not None:
                try:
                    if sink(ev, arrived):
                        return
                except Exception:  # the reader must live on: this request takes the queue
                    log.exception("%s: the event sink failed", ev.request_id)
                    self._sinks.pop(ev.request_id, None)
        q.put_nowait((ev, arrived))

    def _link(self, up: bool) -> bool:
        """Call ``on_link``; False if there is none or it raised."""
        if self.on_link is None:
            return False
        try:
            self.on_link(up)
        except Exception:  # the watch must live on
            log.exception("the link callback of %s failed", self.address)
            return False
        return True

    def _dispatch(self, msg: Message, arrived: float) -> None:
        if isinstance(msg, TaskEvent):
            self._event(msg, arrived)
        elif isinstance(msg, TaskEvents):
            for ev in msg.events:
                self._event(ev, arrived)
        elif isinstance(msg, LoadReport):
            if self.on_report is not None:
                self.on_report(msg)
        elif isinstance(msg, Hello | Ack | Reserved | Fetched | ErrorReply):
            abandoned = self._abandoned.pop(msg.seq, None)
            if abandoned is not None and isinstance(msg, Reserved):
                log.info("%s: a reservation given up on came late; cancelling it", abandoned)
                with contextlib.suppress(zmq.ZMQError):  # its Ack is not awaited
                    self._sock.send(encode(Cancel(seq=next(self._seq), request_id=abandoned)))
                return
            fut = self._pending.get(msg.seq)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        else:
            log.warning("unexpected %s from %s", type(msg).__name__, self.address)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for task in (self._reader, self._watcher):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)


def _with_seq(msg: Message, seq: int) -> Message:
    return msgspec.structs.replace(msg, seq=seq)
