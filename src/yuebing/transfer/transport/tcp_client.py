"""The initiator side of TCP: `TcpTransport` opens a `TcpEndpoint` per peer engine, which keeps
``lanes`` persistent connections (`Lane`), each with a sender and a receiver thread.

Life cycle of a slice: `TcpEndpoint.submit` spreads a batch's slices over the lanes (each to
the lane with the fewest outstanding bytes); a lane's sender thread coalesces what it has queued
into frames — consecutive slices of one segment and direction share one `WriteSlices` /
`ReadSlices` header listing their (offset, length) — records each frame as pending and sends
the frames, write payloads straight from the callers' buffers, in one ``sendmsg``. The receiver
thread matches the answer (`SlicesDone`, one status per slice) by frame id: a write's slices
complete once the target applied them, a read's payloads are received with ``recv_into``
directly into the callers' buffers; the frame's slices are completed with one batch update. When a lane breaks (reset, EOF, stall past ``io_timeout_s``) all its
queued and pending slices are retried on another lane after a backoff that doubles per attempt
(up to ``max_retries``); lanes are re-opened on demand, and if the peer no longer accepts
connections every affected slice fails at once with an error naming the peer.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading

from yuebing.core.errors import TransferError
from yuebing.protocol import Message, ProtocolError
from yuebing.transfer.batch import Slice
from yuebing.transfer.messages import Hello, HelloReply, SegmentDescriptor
from yuebing.transfer.transport.base import TRANSPORTS, Endpoint, LocalContext, Transport
from yuebing.transfer.transport.framing import (
    FrameReader,
    IdleTimeout,
    recv_frame,
    send_frame,
    send_parts,
    tune_socket,
)
from yuebing.transfer.transport.lane_ops import NotifyOp, Op, frame_iovec, group_frames
from yuebing.transfer.transport.tcp_inline import InlineConn, finish_frame

log = logging.getLogger(__name__)

COALESCE_BYTES = 1 << 20
COALESCE_OPS = 256
"""A lane's sender sends queued slices together, up to this many payload bytes / slices per
``sendmsg``; consecutive slices of one segment and direction share one frame (one header, one
`SlicesDone` answer)."""




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
        raise TransferError(f"handshake with peer at {address} failed: {e}") from None


def _open_socket(address: str, ctx: LocalContext,
                 timeout_s: float) -> tuple[socket.socket, HelloReply]:
    host, _, port = address.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except TimeoutError:
        raise
    except (OSError, ValueError) as e:
        raise TransferError(f"peer at {address} is unreachable: {e}") from None
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
        raise TransferError(f"handshake with peer at {address} failed: {e}") from None
    return sock, reply



def drop_ended(ops: list[Op]) -> list[Op]:
    """The ops whose request is still live; the others (their batch timed out or failed while
    they waited for a lane or a retry) are completed here and never sent: the caller may
    already be reusing their buffers."""
    live = [op for op in ops if op.live]
    if len(live) < len(ops):
        for op in ops:
            if not op.live:
                op.complete("the request ended before it was sent")
    return live

class Lane:
    """One persistent connection with a sender and a receiver thread."""

    def __init__(self, endpoint: TcpEndpoint, sock: socket.socket, index: int) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.index = index
        self.outstanding = 0
        self.dead = False
        self._q: queue.SimpleQueue[list[Op] | None] = queue.SimpleQueue()
        self._pending: dict[int, list[Op]] = {}
        """Frames sent and not yet answered: frame id → its ops, in wire order."""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        sock.settimeout(endpoint.ctx.config.io_timeout_s)
        name = f"tx-lane-{endpoint.address}-{index}"
        threading.Thread(target=self._send_loop, name=name + "-tx", daemon=True).start()
        threading.Thread(target=self._recv_loop, name=name + "-rx", daemon=True).start()

    def enqueue(self, ops: list[Op]) -> bool:
        """Queue ``ops`` for sending; False (nothing queued) if the lane is dead."""
        with self._lock:
            if self.dead:
                return False
            self.outstanding += sum(op.length for op in ops)
            self._q.put(ops)
            return True

    def _send_loop(self) -> None:
        """Sender thread: take queued ops (lists put by `enqueue`), register them as pending,
        and send their frames together. Ops it holds when the lane dies go back to the
        endpoint for retry, so none is ever lost."""
        carry: list[Op] = []
        while True:
            if not carry:
                item = self._q.get()
                if item is None:
                    return
                carry = item
            ops, carry = self._take(carry)
            stop = False
            while not carry and len(ops) < COALESCE_OPS:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                more, carry = self._take(item, COALESCE_OPS - len(ops))
                ops += more
            live = drop_ended(ops)
            if len(live) < len(ops):
                with self._lock:
                    self.outstanding -= sum(op.length for op in ops) - sum(op.length for op in live)
                ops = live
            if not ops:
                if stop:
                    if carry:
                        self.endpoint.lane_failed(self, carry, "lane closed")
                    return
                continue
            frames = group_frames(ops)
            with self._lock:
                dead = self.dead
                ids = [] if dead else [next(self._ids) for _ in frames]
                if not dead:
                    self._pending.update(zip(ids, frames, strict=True))
            if dead:
                self.endpoint.lane_failed(self, ops + carry, "lane closed")
                return
            try:
                send_parts(self.sock, [p for fid, frame in zip(ids, frames, strict=True)
                                       for p in frame_iovec(fid, frame)])
            except OSError as e:
                self.fail(f"send to {self.endpoint.address} failed: {e}")
                stop = True
            if stop:
                if carry:
                    self.endpoint.lane_failed(self, carry, "lane closed")
                return

    @staticmethod
    def _take(ops: list[Op], limit: int = COALESCE_OPS) -> tuple[list[Op], list[Op]]:
        """Split ``ops`` into what goes in one ``sendmsg`` (≤ ``limit`` frames, about
        `COALESCE_BYTES` of payload) and the rest."""
        size, n = 0, 0
        for op in ops[:limit]:
            n += 1
            size += op.length
            if size >= COALESCE_BYTES:
                break
        return ops[:n], ops[n:]

    def _recv_loop(self) -> None:
        reader = FrameReader(self.sock)
        while True:
            try:
                msg = reader.read(idle_ok=True)
                self._on_reply(reader, msg)
            except IdleTimeout:
                if self._pending:
                    self.fail(f"peer {self.endpoint.address} sent nothing for "
                              f"{self.endpoint.ctx.config.io_timeout_s}s")
                    return
            except (OSError, ProtocolError) as e:
                self.fail(f"connection to {self.endpoint.address} broke: {e}")
                return

    def _on_reply(self, reader: FrameReader, msg: Message) -> None:
        """Complete the frame ``msg`` answers: every slice at once (reads: payloads received
        straight into the callers' buffers), or the notify."""
        fid = getattr(msg, "id", -1)
        frame = self._pending.pop(fid, None)
        if frame is None:
            raise ProtocolError(f"reply {type(msg).__name__} matches no pending request")
        if not isinstance(frame[0], NotifyOp):
            with self._lock:
                self.outstanding -= sum(op.length for op in frame)
        try:
            finish_frame(reader, frame, msg, self.endpoint.address)
        except (OSError, ProtocolError):
            # broke while receiving the payload: nothing of the frame is completed yet
            # (finish_frame completes last), so it goes back for `fail` to retry or fail it
            self._pending[fid] = frame
            raise

    def fail(self, error: str) -> None:
        """Mark the lane dead, close it, and hand every unfinished op back to the endpoint."""
        with self._lock:
            if self.dead:
                return
            self.dead = True
            ops = [op for frame in self._pending.values() for op in frame]
            self._pending.clear()
            while True:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    ops += item
            self._q.put(None)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        log.debug("lane %s/%d failed with %d ops: %s", self.endpoint.address, self.index,
                  len(ops), error)
        self.endpoint.lane_failed(self, ops, error)


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
        return Lane(self, self._open_sock(), next(self._next_index))

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
            conn = self._inline
            if conn is None:
                try:
                    sock = self._open_sock()
                except TransferError as e:
                    log.debug("no inline connection to %s: %s", self.address, e)
                    return False
                cfg = self.ctx.config
                conn = self._inline = InlineConn(sock, self.address, cfg.io_timeout_s,
                                                 cfg.spin_us * 1e-6)
            slices[0].batch.started_many({s.index for s in slices})
            try:
                left, error = conn.exchange(slices)
            except BaseException:  # e.g. KeyboardInterrupt mid-frame: the stream is out of step
                conn.close()  # its unfinished slices end at the batch deadline
                self._inline = None
                raise
            if left:
                conn.close()
                self._inline = None
                self.lane_failed(None, left, error)  # type: ignore[arg-type]
            return True
        finally:
            self._inline_lock.release()

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
