"""A storage node's landing reports: the node's half of a put committed on landing (docs/store.md,
"Commit on landing"). The node's transfer engine calls `LandingReports.landed` from a lane thread
when a write frame carrying a client's `LandingCommit` landed whole (within its write expiry),
before the frame is answered; this hands the commit to the master as a one-way `Landed` on a
connection of its own, so the client's put needs no commit round trip of its own. A report
that cannot be sent is dropped: the client then sends its commit itself. Built by `StorageNode`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable

from yuebing.protocol import ProtocolError, decode, encode
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import Landed
from yuebing.protocol.transfer import SliceSpec
from yuebing.store.wire import FrameSocket

log = logging.getLogger(__name__)

SEND_S = 0.2
"""Longest a report may take to connect or send (a lane thread waits for it)."""
RETRY_S = 1.0
"""After a failed connection, reports are dropped this long before the next try."""


def span(slices: list[SliceSpec]) -> tuple[int, int] | None:
    """The range (offset, size) that ``slices`` cover back to back, or None when they leave a
    gap (a landing report names one contiguous range)."""
    offset, size = slices[0][0], 0
    for off, length, _, _ in slices:
        if off != offset + size:
            return None
        size += length
    return offset, size


class LandingReports:
    """One node's reports to the leader master (the address its main connection follows now)."""

    def __init__(self, node: str, incarnation: str, master: Callable[[], str], token: str,
                 public: Callable[[str], str]) -> None:
        self.node = node
        self.incarnation = incarnation
        self.public = public
        """A segment's name as mounted at the master, from its name in the node's engine."""
        self.master = master
        self.token = token
        self._lock = threading.Lock()
        self._sock: FrameSocket | None = None
        self._ids = itertools.count(1)
        self._down_until = 0.0
        self.sent = 0
        self.dropped = 0

    def landed(self, segment: str, slices: list[SliceSpec], note: bytes) -> None:
        """`TransferEngine.on_landed`: report the commit in ``note`` (a `LandingCommit`) for the
        range ``slices`` landed in ``segment``; anything else in a note is ignored."""
        try:
            intent = decode(note)
        except ProtocolError as e:
            log.debug("write frame into %s with an unreadable note: %s", segment, e)
            return
        where = span(slices)
        if type(intent) is not m.LandingCommit or where is None:
            return
        payload = encode(Landed(node=self.node, incarnation=self.incarnation,
                                segment=self.public(segment),
                                offset=where[0], size=where[1], rid=intent.rid,
                                commit=intent.commit))
        with self._lock:
            self._send(payload)

    def _send(self, payload: bytes) -> None:
        """Send one report (replies — a standby's NOT_LEADER — are read and dropped first);
        on failure close the connection and drop the report."""
        now = time.monotonic()
        address = self.master()
        sock = self._sock
        if sock is not None and sock.address != address:  # the node follows a new leader
            self._drop()
            sock = None
        try:
            if sock is None:
                if now < self._down_until:
                    self.dropped += 1
                    return
                sock = self._sock = FrameSocket(address, SEND_S, token=self.token)
            while sock.recv(0.0) is not None:
                pass
            sock.send(next(self._ids), payload, timeout_s=SEND_S)
            self.sent += 1
        except OSError as e:
            log.info("landing report to master %s not sent: %s", address, e)
            self.dropped += 1
            self._down_until = now + RETRY_S
            self._drop()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
