"""The initiator side of TCP: `TcpTransport` opens a `TcpEndpoint` per peer engine.

An endpoint keeps ``lanes`` persistent connections (`tcp_lane.Lane`: a sender and a receiver
thread each); `TcpEndpoint.submit` spreads a batch's slices over them (`_dispatch`). A lane
coalesces consecutive slices of one segment and direction into one `WriteSlices` / `ReadSlices`
frame; writes leave from, and reads land straight in, the callers' buffers. When a lane breaks
(reset, EOF, stall past ``io_timeout_s``) its queued and pending slices are retried on another
lane after a backoff that doubles per attempt (up to ``max_retries``, `lane_failed`); lanes
reopen on demand, and a peer that no longer accepts connections fails them at once.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading

from yuebing.core.errors import TransferError
from yuebing.core.spin import window_s
from yuebing.protocol import ProtocolError
from yuebing.protocol.transfer import Hello, HelloReply, SegmentDescriptor
from yuebing.transfer.batch import Slice
from yuebing.transfer.config import SPIN_REF_US
from yuebing.transfer.transport.base import TRANSPORTS, Endpoint, LocalContext, Transport
from yuebing.transfer.transport.framing import (
    recv_frame,
    send_frame,
    tune_socket,
)
from yuebing.transfer.transport.lane_ops import (
    NotifyOp,
    Op,
    drop_ended,
)
from yuebing.transfer.transport.tcp_inline import InlineConn
from yuebing.transfer.transport.tcp_lane import Lane
from yuebing.transfer.types import OpCode

log = logging.getLogger(__name__)


class PeerUnreachable(TransferError):
    """No connection or handshake with the peer's address (refused, timed out, broken)."""



def open_socket(address: str, ctx: LocalContext, timeout_s: float) -> tuple[socket.socket, HelloReply]:
    """Connect to ``host:port`` and run the Hello handshake; raises `TransferError`. A handshake
    that times out (a peer too busy to answer) is tried once more; a refused one is not."""
    try:
        return _open_socket(address, ctx, timeout_s)
    except TimeoutError:
        log.info("handshake with %s timed out after %ss; trying once more", address, timeout_s)
    try:
        return _open_socket(address, ctx, timeout_s)
    except TimeoutError as e:
        raise PeerUnreachable(f"handshake with peer at {address} failed: {e}") from None


def _open_socket(address: str, ctx: LocalContext,
                 timeout_s: float) -> tuple[socket.socket, HelloReply]:
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except TimeoutError:
        raise
    except (OSError, ValueError) as e:
        raise PeerUnreachable(f"peer at {address} is unreachable: {e}") from None
    try:
        tune_socket(sock, ctx.config.socket_buffer, timeout_s)
        send_frame(sock, Hello(engine_id=ctx.engine_id, host_id=ctx.host_id))
        reply = recv_frame(sock)
        if not isinstance(reply, HelloReply):
            raise ProtocolError(f"expected hello reply, got {type(reply).__name__}")
    except TimeoutError:
        sock.close()
        raise
    except (OSError, ProtocolError) as e:
        sock.close()
        raise PeerUnreachable(f"handshake with peer at {address} failed: {e}") from None
    return sock, reply



class TcpEndpoint(Endpoint):
    """``lanes`` persistent connections to one peer engine, with retries across lanes."""

    def __init__(self, ctx: LocalContext, desc: SegmentDescriptor) -> None:
        self.ctx = ctx
        self.address = desc.address
        self.peer_engine = desc.engine_id
        self.slice_size = ctx.config.slice_size
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []
        self._next_index = itertools.count()
        self._retrying = 0
        self._closed = False
        self._dead = ""
        self._inline: InlineConn | None = None
        self._inline_lock = threading.Lock()
        for _ in range(ctx.config.lanes):
            self._lanes.append(self._open_lane())

    def _open_sock(self) -> socket.socket:
        sock, reply = open_socket(self.address, self.ctx, self.ctx.config.connect_timeout_s)
        if reply.engine_id != self.peer_engine:
            sock.close()
            raise TransferError(f"peer at {self.address} is engine {reply.engine_id!r}, expected "
                                f"{self.peer_engine!r} (stale segment metadata?)")
        return sock

    def _open_lane(self) -> Lane:
        return Lane(self.address, self.ctx.config, self.lane_failed, self._open_sock(),
                    next(self._next_index))

    @property
    def alive(self) -> bool:
        return not self._closed and not self._dead

    @property
    def busy(self) -> bool:
        return (self._retrying > 0 or self._inline_lock.locked()
                or any(lane.outstanding for lane in self._lanes))

    def submit(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        if slices:
            slices[0].batch.started_many({s.index for s in slices})
            self._dispatch(slices)  # type: ignore[arg-type]

    def submit_inline(self, desc: SegmentDescriptor, slices: list[Slice]) -> bool:
        """Move ``slices`` (one direction) over the inline connection in this thread; False
        (nothing done) when it is in use by another thread or cannot be opened. Slices it
        could not finish are retried on the lanes, so every slice is completed exactly once."""
        if not slices or not self.alive or not self._inline_lock.acquire(blocking=False):
            return False
        try:
            conn = self._inline_conn()
            if conn is None:
                return False
            slices[0].batch.started_many({s.index for s in slices})
            try:
                left, error = conn.exchange(slices)
            except BaseException:  # e.g. KeyboardInterrupt mid-frame: the stream is out of step
                self._drop_inline()  # its unfinished slices end at the batch deadline
                raise
            if left:
                self._drop_inline()
                self.lane_failed(None, left, error)  # type: ignore[arg-type]
            return True
        finally:
            self._inline_lock.release()

    def exchange_frame(self, segment: str, op: OpCode, items: list[tuple[memoryview, int]],
                       deadline: float, note: bytes = b"") -> list[str] | None:
        """`Endpoint.exchange_frame` over the inline connection (`InlineConn.exchange_frame`);
        None when another thread holds it, it cannot be opened, or it broke (then it is closed)
        under a frame without a ``note``. A noted frame that broke is never moved again: it may
        have landed, and its note with it (a commit the target handed on, after which the range
        is no longer fenced), so each item fails "may have landed" and its sender resolves it."""
        if not self.alive or not self._inline_lock.acquire(blocking=False):
            return None
        try:
            conn = self._inline_conn()
            if conn is None:
                return None
            try:
                errors, why = conn.exchange_frame(segment, op, items, deadline, note)
            except BaseException:  # e.g. KeyboardInterrupt mid-frame: the stream is out of step
                self._drop_inline()
                raise
            if errors is None:
                self._drop_inline()
                if note:
                    return [f"{why}; the frame may have landed, its note too: not sent again"
                            ] * len(items)
                log.debug("%s; the engine moves the frame the submit way", why)
            return errors
        finally:
            self._inline_lock.release()

    def _drop_inline(self) -> None:
        """Close the inline connection (broken, or out of step); the next use opens a new one.
        Called with ``_inline_lock`` held."""
        if self._inline is not None:
            self._inline.close()
            self._inline = None

    def _inline_conn(self) -> InlineConn | None:
        """The inline connection (opened on first use; None if the peer cannot be reached).
        Called with ``_inline_lock`` held."""
        if self._inline is None:
            try:
                sock = self._open_sock()
            except TransferError as e:
                log.debug("no inline connection to %s: %s", self.address, e)
                return None
            cfg = self.ctx.config
            self._inline = InlineConn(sock, self.address, cfg.io_timeout_s, window_s(cfg.spin_us, SPIN_REF_US),
                                      cfg.max_frame_bytes)
        return self._inline

    def notify(self, op: NotifyOp) -> None:
        self._dispatch([op])

    def _dispatch(self, ops: list[Op]) -> None:
        """Spread ``ops`` over the live lanes, each to the lane with the fewest bytes queued."""
        while ops:
            with self._lock:
                lanes = [lane for lane in self._lanes if not lane.dead]
            if not lanes:
                try:
                    lanes = [self._reopen()]
                except TransferError as e:
                    for op in ops:
                        op.complete(str(e))
                    return
            load = [lane.outstanding for lane in lanes]
            groups: list[list[Op]] = [[] for _ in lanes]
            for op in ops:
                i = load.index(min(load))
                groups[i].append(op)
                load[i] += op.length + 1
            ops = [op for lane, group in zip(lanes, groups, strict=True)
                   if group and not lane.enqueue(group) for op in group]

    def _reopen(self) -> Lane:
        if self._closed:
            raise TransferError(f"endpoint to {self.address} is closed")
        try:
            lane = self._open_lane()
        except TransferError as e:
            self._dead = str(e)
            raise
        with self._lock:
            self._lanes.append(lane)
        return lane

    def lane_failed(self, lane: Lane | None, ops: list[Op], error: str) -> None:
        """Called by a lane's thread (or the inline path, ``lane`` None): retry ``ops`` on the
        other lanes after a backoff, or fail them."""
        with self._lock:
            if lane in self._lanes:
                self._lanes.remove(lane)
        cfg = self.ctx.config
        retry: list[Op] = []
        for op in ops:
            op.attempts += 1
            if self._closed or self._dead or op.attempts > cfg.max_retries or not op.live:
                op.complete(self._dead or f"{error} (attempt {op.attempts})")
            else:
                retry.append(op)
        if retry:
            delay = cfg.retry_backoff_s * 2 ** (min(op.attempts for op in retry) - 1)
            with self._lock:
                self._retrying += 1
            timer = threading.Timer(delay, self._retry, args=(retry,))
            timer.daemon = True
            timer.start()

    def _retry(self, ops: list[Op]) -> None:
        ops = drop_ended(ops)
        try:
            with self._lock:
                have = sum(1 for ln in self._lanes if not ln.dead)
            for _ in range(self.ctx.config.lanes - have):
                try:
                    self._reopen()
                except TransferError:
                    break
            self._dispatch(ops)
        finally:
            with self._lock:
                self._retrying -= 1

    def close(self) -> None:
        self._closed = True
        with self._lock:
            lanes, self._lanes = list(self._lanes), []
        for lane in lanes:
            lane.fail(f"endpoint to {self.address} closed")
        conn = self._inline
        if conn is not None:  # an exchange in flight breaks and hands its slices back
            conn.close()


@TRANSPORTS.register("tcp")
class TcpTransport(Transport):
    """TCP lanes: reaches any peer whose listener address is reachable."""

    name = "tcp"

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        return bool(desc.address)

    def connect(self, desc: SegmentDescriptor) -> TcpEndpoint:
        return TcpEndpoint(self.ctx, desc)
