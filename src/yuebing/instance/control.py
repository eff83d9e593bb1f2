"""`ControlServer`: an instance's zmq ROUTER to its Conductors (`protocol.instance` messages)
and the connections subscribed to load reports. Loop thread only.

The host (`base.Instance`) builds it with its config and two callbacks, then `bind`, `serve`
and `close`: one asyncio task per frame, `_handle` decodes it and ``dispatch`` answers it (a
`Refused` or bad frame: an `ErrorReply`). Events and reports leave through `send`; a send that
finds its connection gone calls ``peer_gone``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast

import zmq
import zmq.asyncio

from yuebing.core.errors import EngineError, InputError
from yuebing.instance.config import InstanceConfig
from yuebing.instance.driver import DriverStopped
from yuebing.ops.zap import TokenAuthenticator, serve_plain
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol.instance import ErrorCode, ErrorReply

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request the instance answers with `ErrorReply(code, message)`."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class ControlServer:
    """The control ROUTER of one instance; see the module docstring."""

    def __init__(self, cfg: InstanceConfig,
                 dispatch: Callable[[bytes, Message], Awaitable[Message | None]],
                 peer_gone: Callable[[bytes], None]) -> None:
        self.cfg = cfg
        self.dispatch = dispatch
        """Answers one decoded frame from a connection (None: no reply)."""
        self.peer_gone = peer_gone
        """Told of a connection found gone."""
        self.sock: zmq.asyncio.Socket | None = None
        self.zap: TokenAuthenticator | None = None
        self.subscribers: set[bytes] = set()
        """Connections that sent `Subscribe`: load reports go to each."""
        self._handlers: set[asyncio.Future[Any]] = set()
        """The frames being handled (a reference is kept until each is done)."""

    def bind(self) -> int:
        """Open the ROUTER on ``cfg.host`` at ``cfg.control_port`` (none: a free port);
        returns the port."""
        cfg = self.cfg
        self.sock = self._socket()
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer fails `send`: `_peer_gone`
        if cfg.control_port:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.control_port}")
            return cfg.control_port
        return self.sock.bind_to_random_port(f"tcp://{cfg.host}")

    def _socket(self) -> zmq.asyncio.Socket:
        """The control ROUTER; with a cluster token, in a context of its own whose ZAP handler
        admits only peers presenting it (`ops.zap`)."""
        token = self.cfg.cluster_token
        if not token:
            return zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        ctx = zmq.asyncio.Context()
        self.zap = TokenAuthenticator(ctx, token)
        self.zap.start()
        sock = ctx.socket(zmq.ROUTER)
        serve_plain(sock)
        return sock

    async def serve(self, stop: asyncio.Event) -> None:
        """Answer control frames until ``stop`` is set. Frames already queued are read through
        a synchronous shadow of the socket: the asyncio socket costs a future and a poll per
        frame, so it is awaited only when none is waiting."""
        assert self.sock is not None
        sync: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        stopper = asyncio.ensure_future(stop.wait())
        recv = None
        try:
            while not stop.is_set():
                recv = recv or asyncio.ensure_future(self.sock.recv_multipart())
                done, _ = await asyncio.wait({recv, stopper},
                                             return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    continue
                frames: list[bytes] | None = recv.result()
                recv = None
                while frames is not None and not stop.is_set():
                    # one task per frame: a request that waits (a cancel for its in-flight
                    # writes, a reservation for a step) never holds up the others
                    handler = asyncio.ensure_future(self._handle(frames))
                    self._handlers.add(handler)
                    handler.add_done_callback(self._handlers.discard)
                    try:
                        frames = sync.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        frames = None
        finally:
            stopper.cancel()
            if recv is not None:
                recv.cancel()

    def close(self) -> None:
        """Close the socket (the last events, shutdown errors, get 500 ms to go out) and the
        ZAP handler."""
        if self.sock is not None:
            self.sock.close(linger=500)
        if self.zap is not None:
            self.zap.stop()

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            log.warning("dropped a control message of %d frames", len(frames))
            return
        ident, payload = frames
        seq = 0
        try:
            msg = decode(payload)
            seq = int(getattr(msg, "seq", 0))
            reply = await self.dispatch(ident, msg)
        except ProtocolError as e:
            reply = ErrorReply(seq=seq, code=ErrorCode.BAD_REQUEST, message=str(e))
        except Refused as e:
            reply = ErrorReply(seq=seq, code=e.code, message=str(e))
        except (InputError, ValueError) as e:
            reply = ErrorReply(seq=seq, code=ErrorCode.BAD_REQUEST, message=str(e))
        except EngineError as e:
            reply = ErrorReply(seq=seq, code=ErrorCode.NO_KV, message=str(e))
        except DriverStopped as e:  # a request racing this instance's shutdown
            reply = ErrorReply(seq=seq, code=ErrorCode.SHUTTING_DOWN, message=str(e))
        except Exception as e:
            log.exception("control request failed")
            reply = ErrorReply(seq=seq, code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: "
                               f"{e}")
        if reply is not None:
            self.send(ident, reply)

    def send(self, ident: bytes, msg: Message) -> None:
        """Send without waiting: a message to a full pipe is dropped (as a plain ROUTER does);
        one to a connection that is gone (its Conductor died) ends what it owned."""
        if self.sock is not None and not self.sock.closed:
            sent = cast("asyncio.Future[Any]", self.sock.send_multipart(
                [ident, encode(msg)], flags=zmq.DONTWAIT, copy=False))
            if sent.done():  # always, unless a send is queued: no loop callback per event
                self._sent(ident, sent)
            else:
                sent.add_done_callback(lambda f: self._sent(ident, f))

    def _sent(self, ident: bytes, f: asyncio.Future[Any]) -> None:
        err = None if f.cancelled() else f.exception()
        if isinstance(err, zmq.ZMQError) and err.errno == zmq.EHOSTUNREACH:
            self._peer_gone(ident)

    def _peer_gone(self, ident: bytes) -> None:
        """The connection ``ident`` closed: no more reports to it; its tasks end
        (``peer_gone``)."""
        self.subscribers.discard(ident)
        self.peer_gone(ident)
