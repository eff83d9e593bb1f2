"""Master metadata records: objects, segments, sessions, node tasks. Plain ``__slots__`` classes
in plain dicts keep the hot paths lean (see docs/benchmarks.md for bytes per object). The dicts
belong to `Objects`, `Segments`, `Sessions` and `Tasks`; a record's fields are set by the
component whose rule applies (a lease by `Leases`, a replica move by `Tiers`, ...)."""

from __future__ import annotations

from enum import IntEnum

from yuebing.store.master.allocator import OffsetAllocator


class ObjState(IntEnum):
    """An object's life: allocated and being written, then committed (immutable, visible)."""

    PENDING = 0
    COMMITTED = 1


class SegState(IntEnum):
    """ACTIVE takes new puts; DRAINING is being emptied; SUSPECT: a client's write to it failed,
    so no new put is placed there until its node's next heartbeat proves it alive."""

    ACTIVE = 0
    DRAINING = 1
    SUSPECT = 2


class Obj:
    """One value. ``reps`` is a tuple of ``(segment id, offset)``; ``lease`` / ``soft`` are expiry
    times (0.0 = none); ``owner`` is the client that put it (while PENDING its deadline lives
    in the core's ``pending`` dict; once COMMITTED it only lets that client's retried commit
    answer OK); ``moving`` is the id of an in-flight tier task (0 = none)."""

    __slots__ = ("checksum", "lease", "moving", "owner", "pin", "reps", "size", "soft", "state")

    def __init__(self, size: int, checksum: int, reps: tuple[tuple[int, int], ...],
                 owner: str | None, pin: bool, soft: float) -> None:
        self.size = size
        self.checksum = checksum
        self.reps = reps
        self.state = ObjState.PENDING
        self.owner = owner
        self.lease = 0.0
        self.pin = pin
        self.soft = soft
        self.moving = 0


class Seg:
    """One mounted segment. The allocator is None on a standby (rebuilt at takeover).
    ``incarnation``: the node process that mounted it ("" = not told)."""

    __slots__ = ("alloc", "client", "id", "incarnation", "name", "node", "size", "state", "tier")

    def __init__(self, sid: int, name: str, size: int, tier: int, node: str, client: str,
                 alloc: OffsetAllocator | None, incarnation: str = "") -> None:
        self.id = sid
        self.name = name
        self.size = size
        self.tier = tier
        self.node = node
        self.client = client
        self.state = SegState.ACTIVE
        self.alloc = alloc
        self.incarnation = incarnation


MAX_NAMED_CONNS = 4
"""Connections a session remembers by name (a client opens a new one at each failover)."""


class Session:
    """A client or node known to the master, alive until ``deadline``. ``incarnation``: the
    node process whose segments count (the last to mount); ``retired``: earlier ones.
    ``conns``: the connections it named (`m.ConnName`: its name for one -> the transport's
    identity), at most `MAX_NAMED_CONNS`, oldest first — where the answer to a commit that
    landed with its write goes (`MasterCore.landed`)."""

    __slots__ = ("conns", "deadline", "ident", "incarnation", "retired", "segs")

    def __init__(self, deadline: float, ident: bytes | None) -> None:
        self.deadline = deadline
        self.ident = ident
        self.conns: dict[int, bytes] = {}
        self.segs: set[int] = set()
        self.incarnation = ""
        self.retired: list[str] = []


class Task:
    """An in-flight copy run by a node: a DRAM<->SSD tier move (``kind`` OFFLOAD / PROMOTE) or a
    drain migration to another segment (MIGRATE); ``kind`` is a `cluster_messages.TaskKind` value.
    ``client`` is the node the `NodeTask` went to (only its `TaskDone` counts); ``expiry`` (the
    master's clock) is when the node must stop writing ``dst`` (`NodeTask.expires_in_s`)."""

    __slots__ = ("client", "dst", "expiry", "key", "kind", "size", "src", "waiters")

    def __init__(self, key: str, src: tuple[int, int], dst: tuple[int, int], size: int,
                 kind: int, client: str = "", expiry: float = 0.0) -> None:
        self.key = key
        self.src = src
        self.dst = dst
        self.size = size
        self.kind = kind
        self.client = client
        self.expiry = expiry
        self.waiters: list[object] = []

    @property
    def promote(self) -> bool:
        return self.kind == 1  # TaskKind.PROMOTE (state.py imports no message module)
