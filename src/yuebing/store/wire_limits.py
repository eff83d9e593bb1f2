"""What the master's RPC port lets its peers make it hold: `FrameLimits` and `Intake`.

`wire_server.FrameServer` owns one `Intake` and calls it from its serving thread as bytes
arrive: `admit` and `authenticate` (the cluster-token preamble, `wire.TokenCheck`), `refuse` /
`skip` (a frame over ``max_frame``, dropped as it arrives), `count` (incomplete frames across
connections against ``budget``), `track` / `sweep` (``frame_timeout_s`` per frame, and for the
preamble) and `forget` (a connection closed). The `Intake` closes a connection through the
server's ``close(conn id)``, which calls `forget`; each cut is logged with the peer and why.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from yuebing.store.wire import MAX_FRAME, FrameBuffer, FrameTooLarge, TokenCheck

log = logging.getLogger(__name__)

SWEEP_S = 0.25
"""How often `Intake.sweep` looks for incomplete frames past their deadline."""

Refused = Callable[[int, int, str], None]
"""``on_refused(conn id, request id, why)``: a frame was refused (too long) and dropped."""


@dataclass(frozen=True)
class FrameLimits:
    """What one `FrameServer` port accepts: ``max_frame`` bytes per frame (longer ones are
    refused, up to ``discard_max`` read and dropped, beyond it the connection is closed),
    ``budget`` bytes of incomplete frames across all its connections, and ``frame_timeout_s``
    for a frame's bytes to arrive once its first byte has (0 = no deadline)."""

    max_frame: int = MAX_FRAME
    budget: int = 4 * MAX_FRAME
    frame_timeout_s: float = 0.0
    discard_max: int = MAX_FRAME

    def __post_init__(self) -> None:
        if not 12 < self.max_frame <= min(self.discard_max, MAX_FRAME):
            raise ValueError(f"max_frame must be in 13..min(discard_max, {MAX_FRAME}), "
                             f"got {self.max_frame}")
        if self.budget < self.max_frame:
            raise ValueError(f"budget ({self.budget}) must hold one frame of max_frame "
                             f"({self.max_frame}) bytes")
        if not 0 <= self.frame_timeout_s < 1e9:
            raise ValueError(f"frame_timeout_s must be >= 0 seconds, got {self.frame_timeout_s}")


class Conn:
    """One accepted connection: its incomplete input, unsent output, and the state of a frame
    being received (``started``: monotonic time of its first byte, 0 = none) or refused
    (``skip``: payload bytes still to drop, ``refused``: its request id and why)."""

    __slots__ = ("auth", "backlog", "cid", "counted", "inb", "out", "paused", "peer", "refused",
                 "skip", "sock", "started")

    def __init__(self, sock: socket.socket, cid: int, peer: str, max_frame: int) -> None:
        self.sock = sock
        self.cid = cid
        self.peer = peer
        self.inb = FrameBuffer(max_frame)
        self.out = bytearray()
        self.started = 0.0
        self.skip = 0
        self.refused: tuple[int, str] | None = None
        self.paused = False
        self.counted = 0  # bytes of ``inb`` counted in the intake's ``buffered``
        self.backlog: list[tuple[int, bytes]] = []  # frames read, not served while paused
        self.auth: TokenCheck | None = None  # until the token preamble has been checked


class Intake:
    """The limits on one port's input across its connections; see the module docstring."""

    def __init__(self, limits: FrameLimits, close: Callable[[int], None],
                 on_refused: Refused | None = None, preamble: bytes = b"") -> None:
        self.limits = limits
        self._close = close
        self.on_refused = on_refused
        self._preamble = preamble
        self.buffered = 0
        """Bytes of incomplete frames held across connections (bounded by ``limits.budget``)."""
        self._partial: dict[int, Conn] = {}  # connections with a frame under way
        self._next_sweep = 0.0
        self.cut = 0
        """Connections closed for breaking a limit (oversized, too slow, over the budget) or
        for their cluster token."""
        self.refused_auth = 0
        """Connections closed for a missing or wrong cluster token."""

    def admit(self, c: Conn) -> None:
        """A new connection: with a token, nothing is parsed before its preamble, whose wait
        has a deadline."""
        if self._preamble:
            c.auth = TokenCheck(self._preamble)
            c.started = time.monotonic()
            self._partial[c.cid] = c

    def forget(self, c: Conn) -> None:
        """``c`` was closed: its incomplete input no longer counts."""
        self.buffered -= c.counted
        self._partial.pop(c.cid, None)

    def authenticate(self, c: Conn, data: memoryview) -> memoryview:
        """Feed ``data`` to ``c``'s token check; the bytes after the preamble (empty while it
        is incomplete or when ``c`` was closed for a wrong one)."""
        assert c.auth is not None
        k, why = c.auth.feed(data)
        if why:
            self._refuse_auth(c, why)
        if why or not c.auth.done:
            return data[:0]
        c.auth = None
        c.started = 0.0
        self._partial.pop(c.cid, None)
        return data[k:]

    def _refuse_auth(self, c: Conn, why: str) -> None:
        self.cut += 1
        self.refused_auth += 1
        self._drop(c, f"refused: {why}")

    def skip(self, c: Conn, data: memoryview) -> memoryview:
        """Drop what ``data`` holds of a refused frame's payload (answering the sender once it
        is all read); the bytes after it."""
        k = min(len(data), c.skip)
        c.skip -= k
        if not c.skip:
            self.answer_refused(c)
        return data[k:]

    def refuse(self, c: Conn, e: FrameTooLarge) -> bool:
        """``c``'s buffer starts with the header of a frame over ``max_frame``: drop it and
        its payload (as much as is buffered now, the rest as it arrives) and answer the sender
        once it is all read; False when it is even over ``discard_max`` (close ``c``)."""
        lim = self.limits
        why = (f"request of {e.length} bytes exceeds this port's limit of {lim.max_frame} "
               "bytes (the master's --max-request-bytes): split it")
        if e.length > lim.discard_max:
            log.warning("closing connection %d from %s: a frame of %d bytes was announced "
                        "(limit %d; more than %d is not even read)", c.cid, c.peer, e.length,
                        lim.max_frame, lim.discard_max)
            self.cut += 1
            return False
        log.warning("connection %d from %s: refusing a frame of %d bytes (limit %d); its "
                    "payload is dropped as it arrives", c.cid, c.peer, e.length, lim.max_frame)
        buf = c.inb.buf
        have = min(len(buf) - 12, e.length)
        del buf[:12 + have]
        c.refused = (e.rid, why)
        c.skip = e.length - have
        if not c.skip:
            self.answer_refused(c)
        return True

    def answer_refused(self, c: Conn) -> None:
        if c.refused is not None and self.on_refused is not None:
            self.on_refused(c.cid, *c.refused)
        c.refused = None

    def count(self, c: Conn) -> bool:
        """Count what stays in ``c``'s buffer against the budget; False if ``c`` was closed
        for it."""
        self.buffered += len(c.inb.buf) - c.counted
        c.counted = len(c.inb.buf)
        return self._within_budget(c)

    def track(self, c: Conn) -> None:
        """Note when ``c``'s current incomplete frame began (its deadline counts from then; a
        frame ending restarts it, so a client streaming requests back to back is never cut)."""
        if c.inb.buf or c.skip:
            if not c.started:
                c.started = time.monotonic()
                self._partial[c.cid] = c
            else:
                self._check_deadline(c, time.monotonic())
        else:
            c.started = 0.0
            self._partial.pop(c.cid, None)

    def sweep(self) -> None:
        """Every `SWEEP_S` at most: cut the connections whose frame (or preamble) went quiet
        mid-way past its deadline."""
        if self._partial and self.limits.frame_timeout_s:
            now = time.monotonic()
            if now >= self._next_sweep:
                self._next_sweep = now + SWEEP_S
                for c in list(self._partial.values()):
                    self._check_deadline(c, now)

    def _check_deadline(self, c: Conn, now: float) -> None:
        limit = self.limits.frame_timeout_s
        if limit and c.started and now - c.started > limit and c.auth is not None:
            self._refuse_auth(c, f"no cluster token within {limit}s of connecting")
        elif limit and c.started and now - c.started > limit:
            self.cut += 1
            self._drop(c, f"a frame still incomplete {now - c.started:.1f}s after its first "
                          f"byte (limit {limit}s; {len(c.inb.buf) + c.skip} bytes held or "
                          "pending)")

    def _within_budget(self, c: Conn) -> bool:
        """Over ``budget`` bytes of incomplete frames in all: close the connection holding the
        most (a peer ballooning the server); False if that was ``c``."""
        budget = self.limits.budget
        while self.buffered > budget:
            big = max(self._partial.values(), key=lambda x: len(x.inb.buf), default=c)
            if len(c.inb.buf) > len(big.inb.buf):
                big = c
            self.cut += 1
            self._drop(big, f"{len(big.inb.buf)} bytes of an incomplete frame, with "
                            f"{self.buffered} held by all connections (budget {budget})")
            if big is c:
                return False
        return True

    def _drop(self, c: Conn, why: str) -> None:
        log.warning("closing connection %d from %s: %s", c.cid, c.peer, why)
        self._close(c.cid)
