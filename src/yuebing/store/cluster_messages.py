"""Store messages between the store's own processes (the master RPC messages are in `messages`):
master → node tasks (`NodeTask`, answered by `TaskDone`), leader ↔ standby replication
(`ReplSubscribe`, `ReplSnapshot`, `ReplEntries`, `ReplAck`) and the KV-event stream the master
publishes for the Conductor's index (`KvEvents`).
"""

from __future__ import annotations

from enum import IntEnum

from yuebing.protocol import Message, register_message

# ---------------------------------------------------------------- master <-> node tasks

class TaskKind(IntEnum):
    """What a `NodeTask` does. OFFLOAD / PROMOTE copy between the node's own DRAM segment and
    SSD file; MIGRATE writes a replica from the node's segment (DRAM, or SSD read through its
    file) to ``dst_segment`` on any node through the node's transfer engine (which resolves the
    segment by name, as clients do for put targets)."""

    OFFLOAD = 0
    PROMOTE = 1
    MIGRATE = 2


@register_message
class NodeTask(Message, tag="store.node_task"):
    """Master asks the node owning ``src_segment`` to copy ``size`` bytes to ``dst_segment``
    (see `TaskKind`); the node answers `TaskDone`."""

    task: int
    src_segment: str
    src_offset: int
    dst_segment: str
    dst_offset: int
    size: int
    kind: int = TaskKind.OFFLOAD
    expires_in_s: float = 0.0
    """Seconds from receipt within which the node must have written ``dst``: it starts no task
    past it and bounds a MIGRATE's transfer batch by it (the master reuses the destination of
    a task that failed or was lost only after it plus ``write_grace_s`` + ``fence_s``); 0 =
    no limit from the master."""


@register_message
class TaskDone(Message, tag="store.task_done"):
    """A node's answer to `NodeTask` ``task``; counted only from the node it was sent to."""

    client: str
    task: int
    ok: bool
    message: str = ""


# ---------------------------------------------------------------- replication (leader <-> standby)

@register_message
class ReplSubscribe(Message, tag="store.repl_subscribe"):
    standby: str


@register_message
class ReplSnapshot(Message, tag="store.repl_snapshot"):
    seq: int
    state: bytes


@register_message
class ReplEntries(Message, tag="store.repl_entries"):
    first_seq: int
    entries: list[list]


@register_message
class ReplAck(Message, tag="store.repl_ack"):
    standby: str
    seq: int


# ---------------------------------------------------------------- KV event stream

class EventKind(IntEnum):
    STORED = 0
    REMOVED = 1


@register_message
class KvEvents(Message, tag="store.kv_events"):
    """One batch of the KV-event stream: event i says ``keys[i]`` is now STORED on, or REMOVED
    from, the segments ``holders[i]`` (a value dropped everywhere is REMOVED from all of them;
    a tier move is STORED on the new segment, then REMOVED from the old one)."""

    seq: int
    kinds: list[int]
    keys: list[str]
    holders: list[list[str]]
