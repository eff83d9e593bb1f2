"""Store messages between the store's own processes (the clients' master RPC messages are in
`messages`): a node's segment membership (`Mount`, `Unmount`, `Drain` answered by
`DrainStatus`), master → node tasks (`NodeTask`, answered by `TaskDone`), leader ↔ standby
replication (`ReplSubscribe`, `ReplSnapshot`, `ReplEntries`, `ReplAck`) and the KV-event
stream the master publishes for the Conductor's index (`KvEvents`).
"""

from __future__ import annotations

from enum import IntEnum

from yuebing.protocol import Message, register_message
from yuebing.protocol.store import PutCommit, Tier

# ---------------------------------------------------------------- node -> master: segments

@register_message
class Mount(Message, tag="store.mount"):
    """A node contributes a segment (registered in the transfer engine under ``segment``).
    ``incarnation`` identifies the node process (new at every start): a mount from a new
    incarnation of ``client`` retires the segments of the old one at once (a node restarted
    under the same name); one from an incarnation already retired is refused (EXISTS)."""

    client: str
    segment: str
    size: int
    tier: int = Tier.DRAM
    node: str = ""
    incarnation: str = ""


@register_message
class Unmount(Message, tag="store.unmount"):
    """Withdraw a segment at once: objects lose the replicas it held. With ``incarnation``,
    only that incarnation's mount of the segment (UNKNOWN_SEGMENT if another one holds it)."""

    client: str
    segment: str
    incarnation: str = ""


@register_message
class Drain(Message, tag="store.drain"):
    """Stop placing new values on a segment and migrate the committed values that would be lost
    with it (every replica on draining segments) to active DRAM segments; reply `DrainStatus`.
    Idempotent: a node repeats it until both of the reply's counts are 0. ``incarnation`` as
    in `Unmount`."""

    client: str
    segment: str
    incarnation: str = ""


DRAIN_SAMPLE = 16


@register_message
class DrainStatus(Message, tag="store.drain_status"):
    """Reply to `Drain`. ``at_risk``: values that would be lost if the segment were unmounted
    now (not yet migrated, in flight, or without room elsewhere). ``leased``: values with a
    replica on the segment that a reader still leases (it may be copying from it); reported
    only once ``at_risk`` is 0 (-1 before: not counted)."""

    at_risk: int
    leased: int = -1
    keys: list[str] = []
    """Some of the keys at risk (at most `DRAIN_SAMPLE`), for the node's log."""


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


@register_message
class Landed(Message, tag="store.landed"):
    """One-way, node -> master: a write frame carrying a client's `LandingCommit` landed whole
    in ``segment`` at [``offset``, ``offset + size``) (the frame's slices, as the node received
    them, within the frame's write expiry). The master commits ``commit`` only when the node is
    the segment's current process and that range is the client's pending single-replica
    reservation; it answers the client (request id ``rid`` on the client's connection named
    ``conn``: `store.ConnName`), never the node."""

    node: str
    incarnation: str
    segment: str
    offset: int
    size: int
    rid: int
    conn: int
    commit: PutCommit


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
