"""One TCP lane of a `TcpEndpoint` (`tcp_client`): a persistent connection to a peer engine with
a sender thread (coalesces queued slices into frames, registers them as pending, sends them in
one ``sendmsg``; ops whose request already ended are completed instead of sent) and a receiver
thread (matches answers to pending frames, receives read payloads into the callers' buffers).
When the connection breaks, `Lane.fail` hands every queued and pending op back through the
``failed`` callback it was built with (`TcpEndpoint.lane_failed`: retried on other lanes or
failed).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable

from yuebing.core.spin import window_s
from yuebing.protocol import Message, ProtocolError
from yuebing.transfer.config import SPIN_REF_US, TransferConfig
from yuebing.transfer.transport.framing import FrameReader, IdleTimeout, send_parts
from yuebing.transfer.transport.lane_ops import (
    NotifyOp,
    Op,
    drop_ended,
    frame_iovec,
    group_frames,
)
from yuebing.transfer.transport.tcp_inline import finish_frame
from yuebing.transfer.types import OpCode

log = logging.getLogger(__name__)

COALESCE_BYTES = 1 << 20
COALESCE_OPS = 256
"""A lane's sender sends queued slices together, up to this many payload bytes sent / slices
per ``sendmsg``; consecutive slices of one segment and direction share one frame (one header, one
`SlicesDone` answer)."""


class Lane:
    """One persistent connection with a sender and a receiver thread."""

    def __init__(self, address: str, config: TransferConfig,
                 failed: Callable[[Lane, list[Op], str], None], sock: socket.socket,
                 index: int) -> None:
        self.address, self.config = address, config
        self.failed = failed
        """Takes the ops of a lane that broke or closed (the endpoint retries or fails them)."""
        self.sock = sock
        self.index = index
        self.outstanding = 0
        self.dead = False
        self._q: queue.SimpleQueue[list[Op] | None] = queue.SimpleQueue()
        self._pending: dict[int, list[Op]] = {}
        """Frames sent and not yet answered: frame id → its ops, in wire order."""
        self._ids = itertools.count()
        self._lock = threading.Lock()
        sock.settimeout(config.io_timeout_s)
        self.coalesce = max(COALESCE_BYTES, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2)
        """Payload bytes one ``sendmsg`` takes at most: `COALESCE_BYTES`, or half this
        connection's kernel send buffer when that is larger (it takes them without blocking)."""
        name = f"tx-lane-{address}-{index}"
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
            ops, carry = self._take(carry, COALESCE_OPS, self.coalesce)
            stop = False
            while not carry and len(ops) < COALESCE_OPS:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                more, carry = self._take(item, COALESCE_OPS - len(ops), self.coalesce)
                ops += more
            live = drop_ended(ops)
            if len(live) < len(ops):
                with self._lock:
                    self.outstanding -= sum(op.length for op in ops) - sum(op.length for op in live)
                ops = live
            if not ops:
                if stop:
                    if carry:
                        self.failed(self, carry, "lane closed")
                    return
                continue
            frames = group_frames(ops, self.config.max_frame_bytes)
            with self._lock:
                dead = self.dead
                ids = [] if dead else [next(self._ids) for _ in frames]
                if not dead:
                    self._pending.update(zip(ids, frames, strict=True))
            if dead:
                self.failed(self, ops + carry, "lane closed")
                return
            try:
                send_parts(self.sock, [p for fid, frame in zip(ids, frames, strict=True)
                                       for p in frame_iovec(fid, frame)])
            except OSError as e:
                self.fail(f"send to {self.address} failed: {e}")
                stop = True
            if stop:
                if carry:
                    self.failed(self, carry, "lane closed")
                return

    @staticmethod
    def _take(ops: list[Op], limit: int = COALESCE_OPS,
              nbytes: int = COALESCE_BYTES) -> tuple[list[Op], list[Op]]:
        """Split ``ops`` into what goes in one ``sendmsg`` (≤ ``limit`` ops, about ``nbytes``
        of payload sent) and the rest. A read sends no payload, so a run of
        reads leaves as one frame (one header, one answer) however much it brings back."""
        size, n = 0, 0
        for op in ops[:limit]:
            n += 1
            if getattr(op, "op", None) is OpCode.WRITE:
                size += op.length
                if size >= nbytes:
                    break
        return ops[:n], ops[n:]

    def _recv_loop(self) -> None:
        reader = FrameReader(self.sock, spin_s=window_s(self.config.spin_us, SPIN_REF_US))
        while True:
            try:
                msg = reader.read(idle_ok=True)
                self._on_reply(reader, msg)
            except IdleTimeout:
                if self._pending:
                    self.fail(f"peer {self.address} sent nothing for "
                              f"{self.config.io_timeout_s}s")
                    return
            except (OSError, ProtocolError) as e:
                self.fail(f"connection to {self.address} broke: {e}")
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
            finish_frame(reader, frame, msg, self.address)
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
        log.debug("lane %s/%d failed with %d ops: %s", self.address, self.index,
                  len(ops), error)
        self.failed(self, ops, error)
