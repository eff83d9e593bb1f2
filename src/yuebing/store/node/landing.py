"""A storage node's landing reports: the node's half of a put committed on landing (docs/store.md,
"Commit on landing"). The node's transfer engine calls `LandingReports.landed` from a lane thread
when a write frame carrying a client's `LandingCommit` landed whole (within its write expiry),
before the frame is answered; this hands the commit to the master as a one-way `Landed` on a
connection of its own, so the client's put needs no commit round trip of its own. The lane
thread only ever makes one non-blocking send: a report that would wait (no connection yet, a
full socket buffer, reports queued before it) goes to the sender thread, which connects and
sends. A report that cannot be sent is dropped: the client then sends its commit itself.
Built by `StorageNode`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from yuebing.protocol import ProtocolError, decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Landed
from yuebing.protocol.transfer import SliceSpec
from yuebing.store.wire import FrameSocket, frame

log = logging.getLogger(__name__)

SEND_S = 0.2
"""Longest the sender thread takes to connect or to send one report."""
RETRY_S = 1.0
"""After a failed connection, reports are dropped this long before the next try."""
MAX_QUEUED = 256
"""Reports waiting for the sender thread; more are dropped (their clients commit themselves)."""
DRAIN_S = 1.0
"""How often the idle sender thread reads and drops replies (a standby's NOT_LEADER)."""


def span(slices: list[SliceSpec]) -> tuple[int, int] | None:
    """The range (offset, size) that ``slices`` cover back to back, or None when they leave a
    gap or there are none (a landing report names one contiguous range)."""
    if not slices:
        return None
    offset, size = slices[0][0], 0
    for off, length, _, _ in slices:
        if off != offset + size:
            return None
        size += length
    return offset, size


class LandingReports:
    """One node's reports to the leader master (the address its main connection follows now).
    The lane threads send on the report connection while the sender thread is idle and nothing
    is queued; otherwise the sender thread owns it (``_busy``), so frames never interleave."""

    def __init__(self, node: str, incarnation: str, master: Callable[[], str], token: str,
                 public: Callable[[str], str], local: bool = True) -> None:
        self.node = node
        self.local = local
        """Reach a master dialed on loopback through its Unix socket (`wire.connect_local`)."""
        self.incarnation = incarnation
        self.public = public
        """A segment's name as mounted at the master, from its name in the node's engine."""
        self.master = master
        self.token = token
        self._cv = threading.Condition()
        self._sock: FrameSocket | None = None
        self._queue: deque[tuple[FrameSocket | None, memoryview]] = deque()
        """Reports for the sender thread: (None, a whole frame) for any connection, or (a
        connection, the rest of a frame a lane thread began on it)."""
        self._busy = False
        self._closed = False
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self._thread: threading.Thread | None = None
        self.sent = 0
        self.queued = 0
        self.dropped = 0

    def landed(self, segment: str, slices: list[SliceSpec], note: bytes) -> None:
        """`TransferEngine.on_landed`: report the commit in ``note`` (a `LandingCommit`) for the
        range ``slices`` landed in ``segment``; anything else in a note is ignored. Never
        waits: one non-blocking send, or the report is queued for the sender thread."""
        try:
            intent = decode(note)
        except ProtocolError as e:
            log.debug("write frame into %s with an unreadable note: %s", segment, e)
            return
        where = span(slices)
        if type(intent) is not m.LandingCommit or where is None:
            return
        data = memoryview(frame(next(self._ids), encode(Landed(
            node=self.node, incarnation=self.incarnation, segment=self.public(segment),
            offset=where[0], size=where[1], rid=intent.rid, conn=intent.conn,
            commit=intent.commit))))
        with self._cv:
            if self._closed:
                return
            sock = self._sock
            if (sock is not None and not self._busy and not self._queue
                    and sock.address == self.master()):
                try:
                    n = sock.send_some(data)
                except OSError as e:
                    log.info("landing report to master %s not sent: %s", sock.address, e)
                    self._drop_sock()
                    n = 0
                    sock = None
                if n == data.nbytes:
                    self.sent += 1
                    return
                if n:  # a frame begun on this connection ends on it, or not at all
                    self._enqueue(sock, data[n:])
                    return
            self._enqueue(None, data)

    def _enqueue(self, sock: FrameSocket | None, data: memoryview) -> None:
        """Queue a report for the sender thread (started on first use); called locked."""
        if len(self._queue) >= MAX_QUEUED:
            self.dropped += 1
            return
        self._queue.append((sock, data))
        self.queued += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="landing-reports",
                                            daemon=True)
            self._thread.start()
        self._cv.notify()

    def _run(self) -> None:
        """Sender thread: send the queued reports in order, each on the connection it was begun
        on (dropped if that one is gone) or on the current one (opened as needed)."""
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    if not self._cv.wait(DRAIN_S):
                        self._drain()
                if self._closed:
                    return
                bound, data = self._queue.popleft()
                sock = self._sock
                if bound is not None and bound is not sock:
                    self.dropped += 1  # the rest of a frame on a connection since closed
                    continue
                self._busy = True
            try:
                self._send(sock, data, bound is not None)
            finally:
                with self._cv:
                    self._busy = False

    def _send(self, sock: FrameSocket | None, data: memoryview, rest: bool) -> None:
        """Send one report (or the ``rest`` of one begun on ``sock``) within `SEND_S`, first
        (re)connecting to the leader when needed; on failure close the connection and drop
        the report."""
        now = time.monotonic()
        address = "?"
        try:
            address = self.master()
            if sock is not None and sock.address != address:  # the node follows a new leader
                with self._cv:
                    self._drop_sock()
                if rest:
                    with self._cv:
                        self.dropped += 1
                    return
                sock = None
            if sock is None:
                if now < self._down_until:
                    with self._cv:
                        self.dropped += 1
                    return
                sock = FrameSocket(address, SEND_S, token=self.token, local=self.local)
                with self._cv:
                    if self._closed:
                        sock.close()
                        return
                    self._sock = sock
            sock.send_raw(data, SEND_S)
            with self._cv:  # the caller's thread counts under the lock too
                self.sent += 1
        except Exception as e:  # noqa: BLE001 - whatever breaks one report must not end the thread
            log.info("landing report to master %s not sent: %s", address, e)
            self._down_until = now + RETRY_S
            with self._cv:
                self.dropped += 1
                if self._sock is sock:
                    self._drop_sock()

    def _drain(self) -> None:
        """Read and drop what the master sent (a standby answers NOT_LEADER); called locked."""
        sock = self._sock
        if sock is None:
            return
        try:
            while sock.recv(0.0) is not None:
                pass
        except Exception as e:  # noqa: BLE001 - a bad reply (e.g. over the size limit) too
            log.info("landing connection to master %s dropped: %s", sock.address, e)
            self._drop_sock()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(SEND_S + 1.0)
        with self._cv:
            self._drop_sock()

    def _drop_sock(self) -> None:
        """Close the report connection (locked)."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
