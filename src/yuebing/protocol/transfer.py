"""Wire messages of the transfer engine (TCP lanes) and the segment descriptor published to
the metadata service.

Every frame on a lane is ``[u32 header length][msgpack header]`` optionally followed by raw
payload bytes whose count the header implies (`WriteSlices`, and `SlicesDone` answering a
read); see `yuebing.transfer.transport.framing`. A lane opens with `Hello` → `HelloReply`;
then the initiator sends `WriteSlices` / `ReadSlices` (many slices of one segment per frame) or
`Notify`, and the target answers each, in order, with `SlicesDone` (per-slice status, plus the
read payloads) or `SliceAck` (notify delivered, or an error).
"""

from __future__ import annotations

import msgspec

from yuebing.protocol import Message, register_message


class SegmentDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """What peers need to address a segment: its owner, where to reach it, how big it is and,
    for shared-memory segments, the file a process on the same host can map. ``incarnation``
    (random per registration) tells a segment from an earlier one of the same name: a peer's
    cached descriptor of a segment that was unregistered and registered again is stale."""

    name: str
    engine_id: str
    host_id: str
    address: str
    """``host:port`` of the owner's TCP listener."""
    size: int
    shm_path: str = ""
    incarnation: str = ""


@register_message
class Hello(Message, tag="transfer.hello"):
    engine_id: str
    host_id: str


@register_message
class HelloReply(Message, tag="transfer.hello_reply"):
    engine_id: str
    host_id: str
    segments: list[SegmentDescriptor]


SliceSpec = tuple[int, int, int, int]
"""One slice in a frame: (offset, length, span offset, span length). The span is the whole
request's remote range: the target validates it, not just the slice, so a request that is out
of range anywhere is refused in every slice and nothing of it is written."""


@register_message
class WriteSlices(Message, tag="transfer.writev.fenced"):
    """Followed by the payloads of ``slices`` back to back, each to store at its offset of
    ``segment``. One frame carries many slices of one batch (coalesced per peer and lane).

    ``expiry`` is the write fence: the wall-clock time (``time.time()``) after which the target
    must not write these bytes — the earliest deadline of the frame's batches, converted at
    send time. A target refuses every slice of a frame whose expiry passed before it started
    the frame, and stops receiving an accepted one at expiry + its ``write_grace_s``. (The tag
    changed with the field, so a peer from before the fence fails on an unknown frame type
    instead of writing unfenced.)"""

    id: int
    segment: str
    slices: list[SliceSpec]
    expiry: float
    note: bytes = b""
    """Opaque bytes for the target's application, handed to its engine's landing callback
    (`TransferEngine.on_landed`) once every slice of the frame landed — before the frame is
    answered; nothing happens with them for a frame with a refused slice or one cut short."""


@register_message
class ReadSlices(Message, tag="transfer.readv"):
    """Asks for the bytes of ``slices`` of ``segment``."""

    id: int
    segment: str
    slices: list[SliceSpec]


@register_message
class SlicesDone(Message, tag="transfer.donev"):
    """Answer to `WriteSlices` (after every slice was applied or refused) or `ReadSlices`:
    ``errors`` has one entry per slice, "" for success. A read answer is followed by the
    payloads of the successful slices, back to back, in order."""

    id: int
    errors: list[str]


@register_message
class SliceAck(Message, tag="transfer.ack"):
    """Answer to `Notify` (delivered, or the error of the peer's handler)."""

    id: int
    error: str = ""


@register_message
class Notify(Message, tag="transfer.notify"):
    """A small message for the peer's application, delivered in order on one lane."""

    id: int
    sender: str
    topic: str
    payload: bytes


LaneFrame = WriteSlices | ReadSlices | Notify | Hello
ReplyFrame = SliceAck | SlicesDone | HelloReply
