"""A TCP lane without threads, driven by the submitting thread (small one-direction batches).

The lanes' thread hand-offs would cost more than the bytes. `TcpEndpoint.submit_inline` (in the
thread that called ``submit``) gives an `InlineConn` one peer's slices; `exchange` sends them in
one ``sendmsg`` and reads every answer itself (`finish_frame`, shared with the lanes'
receivers), so ``submit`` returns with the batch terminal; `exchange_frame` (for
`TransferEngine.transfer_status`) moves one frame of whole requests, no batch objects at all.
One direction per exchange: neither side can then fill its send buffer while the other still
sends. A broken or stalled connection is closed; its unfinished slices go back to the lanes.
"""

from __future__ import annotations

import contextlib
import itertools
import select
import socket
import time

from yuebing.core.spin import Spinner
from yuebing.protocol import Message, ProtocolError
from yuebing.protocol.transfer import ReadSlices, SliceAck, SlicesDone, WriteSlices
from yuebing.transfer.batch import Slice, complete_slices
from yuebing.transfer.transport.framing import (
    LOWAT_MIN,
    DeadlineSocket,
    FrameReader,
    pack,
    send_parts,
)
from yuebing.transfer.transport.lane_ops import NotifyOp, Op, frame_iovec, group_frames
from yuebing.transfer.types import OpCode


def finish_frame(reader: FrameReader, frame: list[Op], msg: Message, address: str) -> None:
    """Complete every op of ``frame`` from its answer ``msg`` (reads: the served slices'
    payloads, which follow ``msg`` on the socket, are received into their buffers first).
    Raises `ProtocolError` if ``msg`` does not answer such a frame."""
    first = frame[0]
    refused = f"target {address} refused: "
    if isinstance(first, NotifyOp):
        if not isinstance(msg, SliceAck):
            raise ProtocolError(f"notify answered by {type(msg).__name__}")
        first.complete(refused + msg.error if msg.error else None)
        return
    if not isinstance(msg, SlicesDone) or len(msg.errors) != len(frame):
        raise ProtocolError(f"reply {type(msg).__name__} does not answer a frame of "
                            f"{len(frame)} slices")
    errors = [refused + e if e else None for e in msg.errors]
    if first.op == OpCode.READ:  # payloads of the served slices follow, in order
        run: list[memoryview] = []  # received together with one recvmsg_into
        for op, error in zip(frame, errors, strict=True):
            if error is None:
                if op.live:
                    run.append(op.local)  # type: ignore[union-attr]
                else:  # failed or timed out meanwhile: its buffer is not ours to touch
                    reader.read_into_many(run)
                    run = []
                    reader.skip(op.length)
        reader.read_into_many(run)
    complete_slices(frame, errors)  # type: ignore[arg-type]



def _sent_bytes(frame: list[Op]) -> int:
    """Payload bytes a frame carries to the peer (a write's; a read or notify carries none)."""
    first = frame[0]
    return sum(op.length for op in frame) if getattr(first, "op", None) is OpCode.WRITE else 0


class InlineConn:
    """One connection used by one submitting thread at a time (the endpoint holds a lock)."""

    def __init__(self, sock: socket.socket, address: str, io_timeout_s: float,
                 spin_s: float, max_frame_bytes: int) -> None:
        sock.settimeout(0.0)  # non-blocking: `DeadlineSocket` waits only when a call would block
        self.sock = sock
        self.address = address
        self.io_timeout_s = io_timeout_s
        self.spin_s = spin_s
        self.max_frame_bytes = max_frame_bytes
        self._timed = DeadlineSocket(sock, why="inline exchange ran past its deadline")
        self.reader = FrameReader(self._timed, spin_s=spin_s)  # type: ignore[arg-type]
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)
        self._spinner = Spinner()
        self._ids = itertools.count()

    def exchange(self, slices: list[Slice]) -> tuple[list[Slice], str]:
        """Move ``slices`` (one direction) and complete them. Returns the slices left
        unfinished and why — ``([], "")`` when all were answered; otherwise the connection is
        broken (close it) and the caller must retry or fail the slices it got back."""
        frames = group_frames(slices, self.max_frame_bytes)  # type: ignore[arg-type]
        ids = [next(self._ids) for _ in frames]
        done = 0
        try:
            self._set_timeout(slices[0].deadline)
            send_parts(self._timed, [p for fid, frame in zip(ids, frames, strict=True)  # type: ignore[arg-type]
                                     for p in frame_iovec(fid, frame)])
            for fid, frame in zip(ids, frames, strict=True):
                self._await_reply(_sent_bytes(frame), first=done == 0)
                msg = self.reader.read()
                if getattr(msg, "id", -1) != fid:
                    raise ProtocolError(f"reply {type(msg).__name__} does not answer frame {fid}")
                finish_frame(self.reader, frame, msg, self.address)
                done += 1
        except (OSError, ProtocolError) as e:
            left = [s for frame in frames[done:] for s in frame]
            return left, f"inline connection to {self.address} broke: {e}"  # type: ignore[return-value]
        return [], ""

    def exchange_frame(self, segment: str, op: OpCode, items: list[tuple[memoryview, int]],
                       deadline: float, note: bytes = b"") -> tuple[list[str] | None, str]:
        """Move ``items`` — (local view, remote offset) pairs, each a whole request — to or from
        ``segment`` as one frame, by ``deadline`` (monotonic); a write carries ``note``
        (`WriteSlices.note`). Returns each item's error (""
        when done) — or ``(None, why)`` when the connection broke: close it; what happened to
        the items is unknown, so the caller moves them again (the same bytes to the same place)."""
        fid = next(self._ids)
        specs = [(off, v.nbytes, off, v.nbytes) for v, off in items]
        try:
            self._set_timeout(deadline)
            if op is OpCode.WRITE:  # the frame's fence: its deadline as wall-clock time
                head = pack(WriteSlices(id=fid, segment=segment, slices=specs,
                                        expiry=time.time() + (deadline - time.monotonic()),
                                        note=note))
                parts = [memoryview(head), *(v for v, _ in items)]
            else:
                parts = [memoryview(pack(ReadSlices(id=fid, segment=segment, slices=specs)))]
            send_parts(self._timed, parts)  # type: ignore[arg-type]
            self._await_reply(sum(v.nbytes for v, _ in items) if op is OpCode.WRITE else 0)
            msg = self.reader.read()
            if not isinstance(msg, SlicesDone) or msg.id != fid or len(msg.errors) != len(items):
                raise ProtocolError(f"reply {type(msg).__name__} does not answer frame {fid} "
                                    f"of {len(items)} slices")
            if op is OpCode.READ:  # the payloads of the served slices follow, in order
                self.reader.read_into_many([v for (v, _), e in zip(items, msg.errors,
                                                                   strict=True) if not e])
        except (OSError, ProtocolError) as e:
            return None, f"inline connection to {self.address} broke: {e}"
        refused = f"target {self.address} refused: "
        return [refused + e if e else "" for e in msg.errors], ""

    def _set_timeout(self, deadline: float) -> None:
        """Bound the whole exchange: ``io_timeout_s`` from now, cut short by the batch deadline
        (every socket call re-arms with what is left, see `DeadlineSocket`)."""
        if deadline <= time.monotonic():
            raise TimeoutError("batch deadline passed")
        self._timed.end = min(deadline, time.monotonic() + self.io_timeout_s)

    def _await_reply(self, sent: int, first: bool = True) -> None:
        """Poll for the next answer for up to ``spin_s`` before the blocking read sleeps — not
        after a write of more than `LOWAT_MIN` bytes (``sent``): the peer answers only once it
        has received them all, which takes longer than a wake-up costs, and polling here would
        take the CPU from the very processes moving those bytes; it sleeps in ``poll`` at once
        then (for the ``first`` answer of an exchange: later ones have mostly arrived meanwhile),
        saving the receive that would fail first."""
        if self.reader.buffered:
            return
        if sent > LOWAT_MIN:  # not there yet: sleep at once (a receive would fail first)
            if first:
                self._timed.wait_readable()
        elif self.spin_s:
            self._spinner.wait(lambda: self._poll.poll(0), self.spin_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
