"""Wire messages of the transfer engine (TCP lanes) and the segment descriptor published to
the metadata service.

Every frame on a lane is ``[u32 header length][msgpack header]`` optionally followed by raw
payload bytes whose count the header states (`WriteSlice` and `SliceData`); see
`yuebing.transfer.transport.framing`. A lane opens with `Hello` → `HelloReply`; then the
initiator sends `WriteSlice` / `ReadSlice` / `Notify`, and the target answers each, in order,
with `SliceAck` (write applied, notify delivered, or an error) or `SliceData` (read payload).
"""

from __future__ import annotations

import msgspec

from yuebing.protocol import Message, register_message


class SegmentDescriptor(msgspec.Struct, frozen=True, kw_only=True):
    """What peers need to address a segment: its owner, where to reach it, how big it is and,
    for shared-memory segments, the file a process on the same host can map."""

    name: str
    engine_id: str
    host_id: str
    address: str
    """``host:port`` of the owner's TCP listener."""
    size: int
    shm_path: str = ""


@register_message
class Hello(Message, tag="transfer.hello"):
    engine_id: str
    host_id: str


@register_message
class HelloReply(Message, tag="transfer.hello_reply"):
    engine_id: str
    host_id: str
    segments: list[SegmentDescriptor]


@register_message
class WriteSlice(Message, tag="transfer.write"):
    """Followed by ``length`` payload bytes to store at ``offset`` of ``segment``. ``span`` is the
    whole request's remote (offset, length): the target validates it, not just the slice, so a
    request that is out of range anywhere is refused in every slice and nothing is written."""

    id: int
    segment: str
    offset: int
    length: int
    span: tuple[int, int]


@register_message
class ReadSlice(Message, tag="transfer.read"):
    """Asks for ``length`` bytes at ``offset``; ``span`` as in `WriteSlice`."""

    id: int
    segment: str
    offset: int
    length: int
    span: tuple[int, int]


@register_message
class SliceData(Message, tag="transfer.data"):
    """Answer to `ReadSlice`, followed by ``length`` payload bytes."""

    id: int
    length: int


@register_message
class SliceAck(Message, tag="transfer.ack"):
    """Answer to `WriteSlice` (bytes applied) or `Notify`, or an error for any request."""

    id: int
    error: str = ""


@register_message
class Notify(Message, tag="transfer.notify"):
    """A small message for the peer's application, delivered in order on one lane."""

    id: int
    sender: str
    topic: str
    payload: bytes


LaneFrame = WriteSlice | ReadSlice | Notify | Hello
ReplyFrame = SliceAck | SliceData | HelloReply
