"""The target side of TCP lanes: `TcpServer`, a listener thread plus one thread per connection.

A connection's first frame must be `Hello`, answered with `HelloReply` (P2P handshakes use
exactly this); then its frames are applied in order (`_handle`: `WriteSlices`, `ReadSlices`,
`Notify`). The write fence: a frame whose ``expiry`` passed before it is started is refused
whole, and one still arriving at expiry + ``write_grace_s`` closes the connection, so a sender's
late bytes never land after it gave up. A write frame with a ``note`` that landed whole goes to
the landing callback (`TransferEngine.on_landed`) before it is answered. Replies are held back while more requests arrive
(`ACK_HOLD_FRAMES`) and leave in one ``sendmsg``. Nothing a peer announces is allocated before
its bytes arrive, and every part of a frame has a deadline (`_land`, `_skip`): tricklers are cut.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import threading
import time
from collections.abc import Callable

from yuebing.core.errors import TransferError
from yuebing.core.spin import window_s
from yuebing.protocol import Message, ProtocolError
from yuebing.protocol.transfer import (
    Hello,
    HelloReply,
    Notify,
    ReadSlices,
    SliceAck,
    SlicesDone,
    SliceSpec,
    WriteSlices,
)
from yuebing.transfer.config import SPIN_REF_US, TransferConfig
from yuebing.transfer.segment import SegmentTable
from yuebing.transfer.transport.framing import (
    DeadlineSocket,
    FrameReader,
    IdleTimeout,
    frame_parts,
    send_frame,
    send_parts,
    tune_socket,
)

log = logging.getLogger(__name__)

ACK_HOLD_FRAMES = 64
ACK_HOLD_BYTES = 1 << 20
"""Replies are held back at most this many frames / payload bytes while requests keep coming."""

MAX_SLICE = 1 << 30
"""Largest slice a peer may send (`TransferConfig.slice_size` is at most this)."""

MAX_FRAME_SLICES = 4096
"""Most slices one `WriteSlices` / `ReadSlices` frame may list."""


LandedFn = Callable[[str, list[SliceSpec], bytes], None]
"""A landing callback: (segment, the frame's slices, its note), from a connection thread."""


class TcpServer:
    """Serves this engine's segments to TCP lanes of peer engines. A connection that breaks or
    stalls past ``io_timeout_s`` mid-frame is closed; the others are still served."""

    def __init__(self, config: TransferConfig, segments: SegmentTable,
                 hello: Callable[[Hello], HelloReply],
                 on_notify: Callable[[Notify], None]) -> None:
        self._config = config
        self._segments = segments
        self._hello = hello
        self._on_notify = on_notify
        self.on_landed: LandedFn | None = None
        """Called with each write frame that carries a ``note`` and landed whole (every slice
        accepted and received), before its answer is sent; an exception is logged, the frame
        is answered as landed all the same."""
        self._spin_s = window_s(config.spin_us, SPIN_REF_US)
        """Resolved here, at start-up: with `AUTO` the first call measures the machine (a
        thread ping-pong, milliseconds; seconds on a loaded host), which must not delay the
        first peer's handshake past its ``connect_timeout_s``."""
        self._sock = socket.create_server((config.host, config.port), backlog=128)
        self.port = int(self._sock.getsockname()[1])
        self.address = f"{config.public_host}:{self.port}"
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"tx-accept-{self.port}",
                                        daemon=True)
        self._thread.start()
        self.served_slices = 0

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                break
            tune_socket(conn, self._config.socket_buffer, self._config.io_timeout_s)
            with self._lock:
                if self._closed:
                    conn.close()
                    break
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True,
                             name=f"tx-serve-{peer[1]}").start()

    def _serve(self, conn: socket.socket, peer: object) -> None:
        reader = FrameReader(conn, spin_s=self._spin_s)
        readable = select.poll()
        readable.register(conn, select.POLLIN)
        out: list[memoryview] = []
        try:
            first = reader.read()
            if not isinstance(first, Hello):
                raise ProtocolError(f"expected hello, got {type(first).__name__}")
            send_frame(conn, self._hello(first))
            held = 0
            while not self._closed:
                try:
                    msg = reader.read(idle_ok=True, within_s=self._config.io_timeout_s)
                except IdleTimeout:
                    continue
                held += self._handle(reader, msg, out)
                # Replies wait while more requests are already arriving (a complete frame is
                # buffered, or bytes are readable now), up to ACK_HOLD_FRAMES / ACK_HOLD_BYTES,
                # so a stream of small slices is answered by a few sendmsg calls.
                if out and (len(out) >= ACK_HOLD_FRAMES or held >= ACK_HOLD_BYTES or not (
                        reader.has_frame() or readable.poll(0))):
                    send_parts(conn, out)
                    out.clear()
                    held = 0
        except (OSError, ProtocolError) as e:
            if not self._closed:
                log.debug("lane from %s closed: %s", peer, e)
        except Exception as e:  # e.g. a segment unregistered under an in-flight slice
            log.warning("closing lane from %s after unexpected error: %r", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, reader: FrameReader, msg: Message, out: list[memoryview]) -> int:
        """Apply one request frame; append the reply frame(s) to ``out``; returns the payload
        bytes the frame carried (written or read). `WriteSlices`: each slice validated against
        its segment and its payload received straight into segment memory (`_land`; a refused
        slice's payload drained, `_skip`), then `SlicesDone` with a status per slice;
        `ReadSlices`: `SlicesDone`, then the accepted slices' bytes straight from the segment;
        `Notify`: handed to the engine's callback, then acked with `SliceAck`."""
        if isinstance(msg, WriteSlices):
            views = self._resolve_all(msg.segment, msg.slices)
            if not math.isfinite(msg.expiry):  # NaN would pass every fence comparison
                raise ProtocolError(f"write frame expiry {msg.expiry} is not a finite time")
            late = time.time() - msg.expiry
            if late > 0:  # the write fence: its sender gave up; the space may be reused
                views = [f"write expired {late:.3f}s before the target started it"] * len(views)
            end = msg.expiry + self._config.write_grace_s
            errors: list[str] = []
            run: list[memoryview] = []  # accepted views received together (one recvmsg_into)
            for (_, length, _, _), view in zip(msg.slices, views, strict=True):
                if isinstance(view, str):  # refused: drain its payload, write nothing
                    self._land(reader, run, end)
                    run = []
                    self._skip(reader, length, end)
                    errors.append(view)
                else:
                    run.append(view)
                    errors.append("")
            self._land(reader, run, end)
            if msg.note and self.on_landed is not None and not any(errors):
                try:
                    self.on_landed(msg.segment, msg.slices, msg.note)
                except Exception as e:  # the application's; the bytes landed all the same
                    log.warning("landing callback failed: %r", e)
            out += frame_parts(SlicesDone(id=msg.id, errors=errors))
        elif isinstance(msg, ReadSlices):
            views = self._resolve_all(msg.segment, msg.slices)
            out += frame_parts(SlicesDone(id=msg.id, errors=[
                v if isinstance(v, str) else "" for v in views]))
            out += [v for v in views if not isinstance(v, str)]
        elif isinstance(msg, Notify):
            error = ""
            try:
                self._on_notify(msg)
            except Exception as e:  # the application's callback failed; tell the sender
                log.warning("notify callback failed: %s", e)
                error = f"notify handler failed: {e}"
            out += frame_parts(SliceAck(id=msg.id, error=error))
            self.served_slices += 1
            return 0
        else:
            raise ProtocolError(f"unexpected frame {type(msg).__name__} on a lane")
        self.served_slices += len(msg.slices)
        return sum(spec[1] for spec in msg.slices)

    def _land(self, reader: FrameReader, views: list[memoryview], end: float) -> None:
        """Receive accepted payloads into segment memory, never after ``end`` (wall clock:
        the frame's expiry + ``write_grace_s``): past it the receive raises `TimeoutError`
        and the connection closes. A payload already buffered with its header is copied with
        no system call; otherwise every receive call is armed with the time left (one
        ``settimeout`` each, and one to restore the lane's ``io_timeout_s`` afterwards if any was
        made: a payload taken by non-blocking reads costs none)."""
        if not views:
            return
        if time.time() >= end:  # e.g. refused slices before these took the frame past it
            raise TimeoutError("write frame reached an accepted slice past its expiry + grace; "
                               "closing the lane so nothing more of it is written")
        if reader.buffered >= sum(v.nbytes for v in views):
            reader.read_into_many(views)
            return
        sock = reader.sock
        reader.sock = timed = DeadlineSocket(  # type: ignore[assignment]
            sock, time.monotonic() + (end - time.time()), self._config.io_timeout_s,
            "write frame still arriving past its expiry + grace; closing the lane so nothing "
            "more of it is written")
        try:
            reader.read_into_many(views)
        finally:
            reader.sock = sock
            if timed.armed:  # else the payload came by non-blocking reads: timeout unchanged
                sock.settimeout(self._config.io_timeout_s)

    def _skip(self, reader: FrameReader, nbytes: int, end: float) -> None:
        """Drop a refused slice's ``nbytes`` of payload (through the reader's fixed scratch
        buffer), all of it by ``end`` (wall clock: the frame's expiry + ``write_grace_s``) or
        ``io_timeout_s`` from now if that is later (an expired frame's bytes may still be on
        their way); past it `TimeoutError` closes the connection."""
        if reader.buffered >= nbytes:
            reader.skip(nbytes)
            return
        io_s = self._config.io_timeout_s
        sock = reader.sock
        reader.sock = timed = DeadlineSocket(  # type: ignore[assignment]
            sock, time.monotonic() + max(end - time.time(), io_s), io_s,
            "a refused slice's payload still arriving past its deadline; closing the lane")
        try:
            reader.skip(nbytes)
        finally:
            reader.sock = sock
            if timed.armed:
                sock.settimeout(io_s)

    def _resolve_all(self, segment: str, slices: list[SliceSpec]) -> list[memoryview | str]:
        """Each slice's segment bytes, or the error refusing it. A malformed frame (too many
        slices, a length outside 1..`MAX_SLICE`, more than ``max_frame_bytes`` in all) breaks
        the lane before any of its bytes is read or sent."""
        if not 0 < len(slices) <= MAX_FRAME_SLICES:
            raise ProtocolError(f"frame of {len(slices)} slices outside 1..{MAX_FRAME_SLICES}")
        total = 0
        for spec in slices:
            if not 0 < spec[1] <= MAX_SLICE:
                raise ProtocolError(f"slice length {spec[1]} outside 1..{MAX_SLICE}")
            total += spec[1]
        if total > self._config.max_frame_bytes:
            raise ProtocolError(f"frame of {len(slices)} slices moves {total} payload bytes, over "
                                f"the cap of {self._config.max_frame_bytes} (max_frame_bytes)")
        resolve = self._segments.resolve
        views: list[memoryview | str] = []
        for offset, length, span_off, span_len in slices:
            try:
                views.append(resolve(segment, offset, length, (span_off, span_len)))
            except TransferError as e:
                views.append(str(e))
        return views

    def close(self) -> None:
        """Stop accepting, break every open connection and wait for the listener to end."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2)
