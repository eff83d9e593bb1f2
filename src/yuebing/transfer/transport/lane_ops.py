"""What travels on a TCP lane and how it is framed: `NotifyOp` (a notify awaiting its ack), `Op`
(a slice or a notify), `group_frames` (a sender's queued ops → frames: runs of slices of one
segment and direction share a header), `frame_iovec` (a frame's ``sendmsg`` pieces) and
`drop_ended` (ops whose request ended are completed, never sent). A write frame carries its
expiry (`write_expiry`: the batch deadline as wall-clock time), the target's write fence.

Used by `tcp_lane.Lane`'s sender thread; each frame becomes one `WriteSlices` / `ReadSlices`
(answered by one `SlicesDone`) or one `Notify` (answered by `SliceAck`).
"""

from __future__ import annotations

import threading
import time

from yuebing.protocol.transfer import Notify, ReadSlices, WriteSlices
from yuebing.transfer.batch import Slice
from yuebing.transfer.transport.framing import frame_parts, pack
from yuebing.transfer.types import OpCode


class NotifyOp:
    """A notify travelling on a lane; completed when the peer acknowledges delivery."""

    __slots__ = ("sender", "topic", "payload", "event", "error", "attempts", "length")
    live = True

    def __init__(self, sender: str, topic: str, payload: bytes) -> None:
        self.sender, self.topic, self.payload = sender, topic, payload
        self.event = threading.Event()
        self.error: str | None = None
        self.attempts = 0
        self.length = 0

    def complete(self, error: str | None = None) -> None:
        self.error = error
        self.event.set()


Op = Slice | NotifyOp


def group_frames(ops: list[Op], max_bytes: int) -> list[list[Op]]:
    """Group ``ops`` (in order) into frames: runs of slices with the same direction and
    segment share one, up to ``max_bytes`` of payload (`TransferConfig.max_frame_bytes`, which
    the target enforces); a notify travels alone."""
    frames: list[list[Op]] = []
    key: object = None
    size = 0
    for op in ops:
        k = None if isinstance(op, NotifyOp) else (op.op, op.segment)
        if k is None or k != key or size + op.length > max_bytes:
            frames.append([op])
            size = op.length
        else:
            frames[-1].append(op)
            size += op.length
        key = k
    return frames


def frame_iovec(fid: int, frame: list[Op]) -> list[memoryview]:
    """The iovec pieces of one frame: header, then (writes) every slice's local bytes."""
    first = frame[0]
    if isinstance(first, NotifyOp):
        return frame_parts(Notify(id=fid, sender=first.sender, topic=first.topic,
                                  payload=first.payload))
    specs = [(s.offset, s.length, *s.span) for s in frame]  # type: ignore[union-attr]
    if first.op == OpCode.WRITE:
        head = pack(WriteSlices(id=fid, segment=first.segment, slices=specs,
                                expiry=write_expiry(frame)))  # type: ignore[arg-type]
        return [memoryview(head), *(s.local for s in frame)]  # type: ignore[union-attr]
    return [memoryview(pack(ReadSlices(id=fid, segment=first.segment, slices=specs)))]


def write_expiry(frame: list[Slice]) -> float:
    """The fence of a write frame: the earliest deadline of its slices' batches (monotonic),
    as wall-clock time now — the target's clock is not this process's monotonic one."""
    batch = frame[0].batch
    deadline = batch.deadline
    for s in frame:
        if s.batch is not batch:
            batch = s.batch
            deadline = min(deadline, batch.deadline)
    return time.time() + (deadline - time.monotonic())


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
