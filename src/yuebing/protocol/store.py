"""Wire messages of the store: master RPC requests/replies of its clients (a node's segment
membership, node tasks, replication and KV events between the store's processes are in
`cluster_messages`).

Every message is a tagged msgspec struct (``yuebing.protocol``). A request gets exactly one reply:
the typed reply named beside it, or `Err` (a `Code` and a message). Batch forms answer with one
`Code` per key in request order, so one bad key never fails its neighbours.
"""

from __future__ import annotations

from enum import IntEnum

from yuebing.protocol import Message, register_message


class Code(IntEnum):
    """Result of one operation on one key."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2
    NO_SPACE = 3
    LEASED = 4
    NOT_PENDING = 5
    BAD_REQUEST = 6
    NOT_LEADER = 7
    UNKNOWN_SEGMENT = 8
    PROMOTING = 9
    PINNED = 10
    INTERNAL = 11
    NOT_INLINE = 12
    """The master does not hold this value itself (inline off, over its limit or its budget,
    replicas or a placement it cannot honour): put it the normal way (`PutInline`)."""
    COMMITTED = 13
    """A revoke (`BatchPutRevoke`) of a reservation that a commit of the same client already
    consumed — one that landed with its write (`LandingCommit`) while the client saw the write
    fail: the value is stored, nothing was revoked, the put is done."""


class Tier(IntEnum):
    DRAM = 0
    SSD = 1


INLINE_HOLDER = "@master"
"""The holder a STORED / REMOVED event names for a value the master holds itself (`PutInline`)."""

RESERVED_PREFIX = "\x00resv/"
"""Keys of reservations (space allocated ahead for a client's next put, `Reservation`) start
with this; the store refuses user keys that do."""


# ---------------------------------------------------------------- shared pieces

class Replica(Message, tag="store.replica"):
    """Where one copy of a value lives: (segment, offset) in the transfer engine's address space."""

    segment: str
    offset: int
    tier: int = Tier.DRAM


class PutItem(Message, tag="store.put_item"):
    key: str
    size: int
    checksum: int = -1
    replicas: int = 1
    strategy: str = ""
    preferred: list[str] = []
    hard_pin: bool = False
    soft_pin_s: float = 0.0
    timeout_s: float = 0.0
    """The client's transfer timeout: the master's write expiry for the put is now + the shorter
    of this and its ``put_timeout_s`` (0 = ``put_timeout_s``)."""
    min_replicas: int = 0
    """Fewest replicas the put accepts (best effort: 1..``replicas``); 0 = all ``replicas``: a
    put that cannot place every copy on distinct DRAM segments is refused (NO_SPACE)."""


# ---------------------------------------------------------------- client -> master

@register_message
class PutStart(Message, tag="store.put_start"):
    """Allocate space for a new value; reply `PutTargets`. The value is invisible until PutEnd.
    With ``reserve_next`` the master also allocates a `Reservation` for the client's next put of
    the same shape (size, replicas, strategy, preferred), returned in `PutTargets.reservation`."""

    client: str
    item: PutItem
    reserve_next: bool = False


@register_message
class PutCommit(Message, tag="store.put_commit"):
    """One-RPC put: the client wrote ``item``'s bytes into its ``reservation``; the master stores
    them under ``item.key`` (checksum and pins from ``item``, committed like `PutEnd`) and, with
    ``reserve_next``, places the next reservation of the same shape. Reply `PutCommitted`; a
    refusal (no such pending reservation of this client, write expiry passed, shape mismatch,
    key exists) is an `Err` and the client puts the value the two-phase way instead."""

    client: str
    reservation: str
    item: PutItem
    reserve_next: bool = False


@register_message
class LandingCommit(Message, tag="store.landing_commit"):
    """A `PutCommit` that rides on the write frame into its reservation (`WriteSlices.note`)
    instead of going to the master after the write: the node that lands the whole frame hands
    it on to the master (`store_cluster.Landed`), which commits it and sends the reply to the
    client's master connection named ``conn`` (`ConnName`) as the answer to request id ``rid``
    (one never sent there). A client that gets no such answer soon sends ``commit`` itself."""

    rid: int
    conn: int
    commit: PutCommit


@register_message
class ConnName(Message, tag="store.conn_name"):
    """One-way (no reply): ``client`` names the connection this arrives on ``conn`` (a random
    nonzero 62-bit number it draws for each connection it opens), so that the master answers a
    commit that landed with the client's write (`LandingCommit.conn`) on that very connection.
    A client that commits on landing sends it ahead of its first request on each connection,
    in the same send."""

    client: str
    conn: int


@register_message
class PutInline(Message, tag="store.put_inline"):
    """One-RPC put of a small value the master holds itself: ``value`` (``item.size`` bytes)
    rides in the request and the value is committed (visible, a STORED event) when it is
    applied. Reply `Ok`; `InlineRefused` when the master will not hold it (the client puts it
    the normal way); `Err` EXISTS for a key that exists (a resend of the same client's put of
    the same bytes answers OK) or BAD_REQUEST."""

    client: str
    item: PutItem
    value: bytes


@register_message
class BatchPutInline(Message, tag="store.batch_put_inline"):
    """`PutInline` of many items (``values[i]`` is item ``i``'s); reply `InlineCodes`, a code
    per item (NOT_INLINE: put that one the normal way)."""

    client: str
    items: list[PutItem]
    values: list[bytes]


@register_message
class PutEnd(Message, tag="store.put_end"):
    """Commit a value whose bytes were written to every target; reply `Ok`."""

    client: str
    key: str


@register_message
class PutRevoke(Message, tag="store.put_revoke"):
    """Abandon a pending put and free its space; reply `Ok`. ``failed`` names the segments the
    write could not reach: the master stops placing there until their node heartbeats again."""

    client: str
    key: str
    failed: list[str] = []


@register_message
class BatchPutStart(Message, tag="store.batch_put_start"):
    """`PutStart` of many items; reply `BatchPutTargets`. With ``reserve_next`` > 0 and items
    of one shape, the master also places up to that many reservations of the shape for the
    client's next batch (`BatchPutTargets.reservations`)."""

    client: str
    items: list[PutItem]
    reserve_next: int = 0


@register_message
class BatchPutCommit(Message, tag="store.batch_put_commit"):
    """`PutCommit` of many items: item ``i`` was written into ``reservations[i]``; reply
    `BatchPutCommitted` with a code per item (a refused item changes nothing: its reservation
    stays, the client puts the value the two-phase way) and, with ``reserve_next`` > 0 and
    items of one shape, up to that many reservations of the shape for the next batch."""

    client: str
    reservations: list[str]
    items: list[PutItem]
    reserve_next: int = 0


@register_message
class BatchPutEnd(Message, tag="store.batch_put_end"):
    client: str
    keys: list[str]


@register_message
class BatchPutRevoke(Message, tag="store.batch_put_revoke"):
    """Abandon pending puts (``keys``: their ranges wait out the write fence) and give back
    reservations no write ever used (``unused``: freed at once); reply `Codes`, one per key of
    ``keys`` then of ``unused``. ``failed`` as in `PutRevoke`."""

    client: str
    keys: list[str]
    failed: list[str] = []
    unused: list[str] = []


@register_message
class GetReplicas(Message, tag="store.get_replicas"):
    """Replicas of a committed value plus a read lease; reply `ReplicaList`."""

    key: str


@register_message
class BatchGetReplicas(Message, tag="store.batch_get_replicas"):
    keys: list[str]


@register_message
class ReleaseLeases(Message, tag="store.release_leases"):
    """One-way (no reply): the reads of these keys under these leases (`ReplicaList.lease_id`)
    are over. A lease ends when every reader it was granted to released it (or at its
    ``lease_s``, whichever comes first); a release of an older lease is ignored."""

    keys: list[str]
    ids: list[int]


@register_message
class Exists(Message, tag="store.exists"):
    """Is the key committed? Reply `Bools` with one entry. A probe: grants no lease."""

    key: str


@register_message
class BatchExists(Message, tag="store.batch_exists"):
    keys: list[str]


@register_message
class PrefixMatch(Message, tag="store.prefix_match"):
    """Length of the longest leading run of ``keys`` that are all committed; reply `Count`."""

    keys: list[str]


@register_message
class Remove(Message, tag="store.remove"):
    """Remove a committed value; refused with LEASED/PINNED unless ``force``; reply `Ok`."""

    key: str
    force: bool = False


@register_message
class BatchRemove(Message, tag="store.batch_remove"):
    keys: list[str]
    force: bool = False


@register_message
class RemovePrefix(Message, tag="store.remove_prefix"):
    """Remove every committed key starting with ``prefix``; reply `Removed` (how many removed,
    and the keys kept because a reader leases them or they are hard-pinned)."""

    prefix: str
    force: bool = False


@register_message
class RemoveAll(Message, tag="store.remove_all"):
    force: bool = False


@register_message
class Pin(Message, tag="store.pin"):
    """Hard-pin, soft-pin (TTL ``soft_pin_s``) or, with ``unpin``, clear pins; reply `Codes`."""

    keys: list[str]
    hard: bool = False
    soft_pin_s: float = 0.0
    unpin: bool = False


@register_message
class Heartbeat(Message, tag="store.heartbeat"):
    """Keeps ``client``'s session alive; reply `HeartbeatReply`. A node sends its
    ``incarnation``: its suspected segments take puts again; a retired incarnation (the name
    was mounted by a newer process) is refused (EXISTS) and should stop."""

    client: str
    incarnation: str = ""


@register_message
class GetStats(Message, tag="store.get_stats"):
    """Usage and counters; reply `Stats`."""


# ---------------------------------------------------------------- master -> client replies

@register_message
class Ok(Message, tag="store.ok"):
    pass


@register_message
class Err(Message, tag="store.err"):
    code: int
    message: str
    leader: str = ""


@register_message
class InlineRefused(Message, tag="store.inline_refused"):
    """Reply of `PutInline`: the master does not hold this value (``message`` says why); it
    holds values of at most ``max_bytes`` now (0: none — inline off, or its budget is full of
    pinned values), so the client stops asking for larger ones for a while."""

    max_bytes: int
    message: str


@register_message
class InlineCodes(Message, tag="store.inline_codes"):
    """Reply of `BatchPutInline`: a `Code` per item, and ``max_bytes`` as in `InlineRefused`."""

    codes: list[int]
    max_bytes: int


@register_message
class PutTargets(Message, tag="store.put_targets"):
    """Where to write a put's bytes, and ``expires_in_s``: seconds from the master's reply until
    the put's write expiry. The client must finish its writes by then (it converts this to its
    own monotonic deadline, measured from before its request); targets refuse later writes and
    the master keeps the space of an uncommitted put unused until well after it."""

    key: str
    replicas: list[Replica]
    expires_in_s: float
    reservation: Reservation | None = None
    """With `PutStart.reserve_next`: space for the client's next put of the same shape."""


class Reservation(Message, tag="store.reservation"):
    """Space allocated ahead for a client's next put of one shape: a pending put under an
    internal ``key`` (`RESERVED_PREFIX`) that only its client can fill (write to ``replicas``
    by ``expires_in_s`` from the reply, measured like `PutTargets`) and commit (`PutCommit`)
    or give back (`PutRevoke`)."""

    key: str
    replicas: list[Replica]
    expires_in_s: float


@register_message
class PutCommitted(Message, tag="store.put_committed"):
    """Reply of `PutCommit`: the value is stored; ``reservation`` is the next one, if asked
    for and there was room."""

    reservation: Reservation | None = None


@register_message
class BatchPutTargets(Message, tag="store.batch_put_targets"):
    """`PutTargets` of many items; ``expires_in_s`` is the earliest expiry of those placed."""

    codes: list[int]
    replicas: list[list[Replica]]
    expires_in_s: float
    reservations: list[Reservation] = []
    """With `BatchPutStart.reserve_next`: space for the client's next batch of the shape."""


@register_message
class BatchPutCommitted(Message, tag="store.batch_put_committed"):
    """Reply of `BatchPutCommit`: a `Code` per item, and the next reservations if asked for."""

    codes: list[int]
    reservations: list[Reservation] = []


@register_message
class ReplicaList(Message, tag="store.replica_list"):
    """Where to read a committed value, and ``lease_s``: seconds from the master's reply that
    the value stays put (not evicted, moved off these replicas or removed unforced). The client
    converts it to its own monotonic deadline, measured from before its request, and starts no
    read past it (it asks again); 0 = no lease (``--lease-ttl-s 0``): reads are not bounded.
    ``lease_id`` names the lease for `ReleaseLeases`, which the client sends once its read is
    over, so the value is evictable and removable at once, not only when ``lease_s`` ends."""

    key: str
    size: int
    checksum: int
    replicas: list[Replica]
    lease_s: float
    lease_id: int = 0
    value: bytes | None = None
    """The value itself when the master holds it (`PutInline`): no replicas, no lease."""


@register_message
class BatchReplicaList(Message, tag="store.batch_replica_list"):
    """`ReplicaList` of many keys; ``lease_s`` holds for every key found (``codes`` OK), each
    under its ``lease_ids`` entry (0 where not found)."""

    codes: list[int]
    sizes: list[int]
    checksums: list[int]
    replicas: list[list[Replica]]
    lease_s: float
    lease_ids: list[int] = []
    values: list[bytes | None] = []
    """When any key's value is held by the master (`PutInline`): a value or None per key."""


@register_message
class Bools(Message, tag="store.bools"):
    values: list[bool]


@register_message
class Codes(Message, tag="store.codes"):
    codes: list[int]


@register_message
class Count(Message, tag="store.count"):
    n: int


REMOVED_SAMPLE = 1000


@register_message
class Removed(Message, tag="store.removed"):
    """Reply to `RemovePrefix` / `RemoveAll`: ``n`` values removed; ``kept`` values matched but
    stayed (unforced): those a reader leases — their keys in ``leased`` — and hard-pinned ones
    (``pinned``), at most `REMOVED_SAMPLE` keys listed in each."""

    n: int
    kept: int = 0
    leased: list[str] = []
    pinned: list[str] = []


@register_message
class HeartbeatReply(Message, tag="store.heartbeat_reply"):
    segments: list[str]
    """Segments the master holds for this client; a node re-mounts any that is missing."""


@register_message
class Stats(Message, tag="store.stats"):
    values: dict[str, float]
