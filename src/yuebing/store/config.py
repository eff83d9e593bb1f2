"""Frozen configs of the store roles: `MasterConfig`, `NodeConfig`, `ClientConfig`.

The CLI (``yuebing store master|node``) is generated from these with `add_config_args`; every
value is validated in ``__post_init__`` and a bad one raises `ConfigError` naming the flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from yuebing.core.auth import TOKEN_HELP, env_cluster_token, host_of, require_token
from yuebing.core.config import require
from yuebing.core.spin import AUTO

MASTER_SPIN_REF_US = 500
"""The master's spin window on the reference core (`core.spin.window_s`)."""
CLIENT_SPIN_REF_US = 100
"""A client's spin window for a master reply on the reference core."""

PLACEMENTS = ("random", "free_ratio", "local_first", "preferred")
HELD_OVERHEAD = 512
"""Bytes a value the master holds counts against ``inline_capacity`` beyond its own: its
metadata (key, `Obj`, table entries; ~420 B measured), so tiny values cannot pile up unbounded."""
INLINE_BATCH_BYTES = 1 << 20
"""Most value bytes one `BatchPutInline` of a client carries; a master with a smaller
``max_request_bytes`` still reads it whole and answers BAD_REQUEST (the client then puts the
values the normal way)."""
INLINE_MAX_BYTES = 16 << 10
"""Default largest value the master holds itself (client and master `inline_max_bytes`)."""


@dataclass(frozen=True)
class MasterConfig:
    """The metadata master (one leader, any number of standbys)."""

    rpc_address: str = field(default="tcp://127.0.0.1:50151",
                             metadata={"help": "TCP address the master RPC binds"})
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata={
        "help": TOKEN_HELP + "; also sent when following a leader", "secret": True})
    events_address: str = field(default="", metadata={
        "help": "ZeroMQ PUB address for the KV-event stream ('' = no stream)"})
    admin_host: str = field(default="127.0.0.1", metadata={
        "help": "address the admin HTTP binds (127.0.0.1: this host only)"})
    admin_port: int = field(default=0, metadata={
        "help": "admin HTTP port (/health /keys /segments /usage /metrics); 0 = off"})
    client_ttl_s: float = field(default=10.0, metadata={
        "help": "a session (client or node) silent this long is dead: its segments, replicas "
                "and pending puts are dropped"})
    lease_ttl_s: float = field(default=5.0, metadata={
        "help": "read lease granted by get_replicas; leased objects are never evicted"})
    put_timeout_s: float = field(default=30.0, metadata={
        "help": "a put not ended within this many seconds is a zombie and reclaimed"})
    write_grace_s: float = field(default=1.0, metadata={
        "help": "the nodes' transfer --write-grace-s (a target may still receive a write frame "
                "this long past its expiry); must not be smaller than theirs"})
    fence_s: float = field(default=2.0, metadata={
        "help": "clock-skew allowance of the write fence: space of a revoked, timed-out or "
                "orphaned put is reused only at its write expiry + write_grace_s + this"})
    high_watermark: float = field(default=0.95, metadata={
        "help": "DRAM usage ratio above which LRU eviction starts"})
    evict_ratio: float = field(default=0.05, metadata={
        "help": "eviction frees down to high_watermark - evict_ratio"})
    room_wait_s: float = field(default=2.0, metadata={
        "help": "longest a put waits for DRAM room that is on its way (victims being offloaded "
                "to an SSD tier, read leases ending) before it fails with NO_SPACE; keep it "
                "below the clients' --rpc-timeout-s"})
    default_soft_pin_s: float = field(default=60.0, metadata={
        "help": "TTL of a soft pin when the put asks for one without a TTL"})
    placement: str = field(default="free_ratio", metadata={
        "help": f"default replica placement: {', '.join(PLACEMENTS)}"})
    alignment: int = field(default=64, metadata={"help": "allocation alignment in bytes"})
    tick_s: float = field(default=0.1, metadata={
        "help": "period of housekeeping (TTL sweep, zombie reclaim, watermark eviction)"})
    etcd: str = field(default="", metadata={
        "help": "etcd URL (http://host:port) for leader election; '' = single master"})
    cluster: str = field(default="default", metadata={"help": "cluster name (etcd key prefix)"})
    election_ttl_s: int = field(default=3, metadata={"help": "leader lease TTL in etcd (s)"})
    sync_replication: bool = field(default=True, metadata={
        "help": "hold replies of mutating calls until every standby acknowledged them"})
    repl_timeout_s: float = field(default=2.0, metadata={
        "help": "a standby that does not acknowledge within this is dropped from sync replication"})
    seed: int = field(default=0, metadata={"help": "seed of the random placement"})
    drain_parallel: int = field(default=8, metadata={
        "help": "most migrations in flight at once while segments drain (copies of values "
                "whose every replica is on a draining segment, to active DRAM segments)"})
    spin_us: int = field(default=AUTO, metadata={
        "help": "after serving a request, poll this many microseconds for the next one before "
                "sleeping (a wake-up from sleep costs ~6-20 us on a VM); 0 = always sleep; -1 "
                f"(default) = chosen for this machine at start-up ({MASTER_SPIN_REF_US} us "
                "on the reference core, scaled by this core's measured speed: a client's 1 MiB "
                "write between put_start and put_end; 0 on one CPU or where wake-ups are cheap)"})
    local_socket: bool = field(default=True, metadata={
        "help": "also listen on a Linux abstract Unix socket named after the RPC address, for "
                "clients and nodes that dial it on loopback (a round trip skips the TCP stack; "
                "the name held by another socket is a start-up error)"})
    max_request_bytes: int = field(default=8 << 20, metadata={
        "help": "largest RPC request the master takes (a batch of ~100k keys fits in 8MiB); a "
                "longer one is refused with BAD_REQUEST (its bytes read and dropped, never "
                "held; announced over 8x this, the connection is closed at once)", "size": True})
    rpc_buffer_bytes: int = field(default=256 << 20, metadata={
        "help": "memory budget of incomplete requests across all RPC connections: over it, "
                "the connection holding the most is closed", "size": True})
    frame_timeout_s: float = field(default=10.0, metadata={
        "help": "a request's bytes must all arrive within this many seconds of its first "
                "byte, else its connection is closed (a peer trickling bytes holds nothing "
                "for long)"})
    inline_max_bytes: int = field(default=INLINE_MAX_BYTES, metadata={
        "help": "the master holds a value of at most this many bytes itself (one put RPC, "
                "the value in a get's reply: one round trip each), replicated to its standbys "
                "with the commit; 0 = off (every value goes to a node's segment)", "size": True})
    inline_capacity: int = field(default=256 << 20, metadata={
        "help": "bytes of values the master holds itself (--inline-max-bytes); a put past it "
                "evicts the least recently used unpinned ones, or goes to a segment",
                "size": True})

    def __post_init__(self) -> None:
        require(self.rpc_address.startswith(("tcp://", "ipc://", "inproc://")),
                f"--rpc-address must be a ZeroMQ address like tcp://127.0.0.1:50151, "
                f"got {self.rpc_address!r}")
        _seconds("--client-ttl-s", self.client_ttl_s)
        _seconds("--lease-ttl-s", self.lease_ttl_s, zero_ok=True)
        _seconds("--put-timeout-s", self.put_timeout_s)
        require(0 <= self.write_grace_s <= 60,
                f"--write-grace-s must be in 0..60 seconds, got {self.write_grace_s}")
        require(0 <= self.fence_s <= 600, f"--fence-s must be in 0..600 seconds, got {self.fence_s}")
        require(0.0 < self.high_watermark <= 1.0,
                f"--high-watermark must be in (0, 1], got {self.high_watermark}")
        require(0.0 < self.evict_ratio < self.high_watermark,
                f"--evict-ratio must be in (0, high_watermark), got {self.evict_ratio}")
        require(self.placement in PLACEMENTS,
                f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        require(self.alignment >= 1 and self.alignment & (self.alignment - 1) == 0,
                f"--alignment must be a power of two, got {self.alignment}")
        _seconds("--tick-s", self.tick_s)
        _seconds("--room-wait-s", self.room_wait_s, zero_ok=True)
        require(self.drain_parallel >= 1,
                f"--drain-parallel must be >= 1, got {self.drain_parallel}")
        require(AUTO <= self.spin_us <= 100_000,
                f"--spin-us must be in 0..100000 or -1 (auto), got {self.spin_us}")
        require(4096 <= self.max_request_bytes <= 1 << 30,
                f"--max-request-bytes must be in 4KiB..1GiB, got {self.max_request_bytes}")
        require(self.rpc_buffer_bytes >= self.max_request_bytes,
                f"--rpc-buffer-bytes ({self.rpc_buffer_bytes}) must be at least "
                f"--max-request-bytes ({self.max_request_bytes})")
        _seconds("--frame-timeout-s", self.frame_timeout_s)
        require(0 <= self.inline_max_bytes <= min(1 << 20, self.max_request_bytes // 2),
                f"--inline-max-bytes must be in 0..min(1MiB, --max-request-bytes / 2), "
                f"got {self.inline_max_bytes}")
        least = self.inline_max_bytes + HELD_OVERHEAD if self.inline_max_bytes else 0
        require(least <= self.inline_capacity <= 512 << 20,
                f"--inline-capacity must be in {least} (--inline-max-bytes + {HELD_OVERHEAD} "
                f"bytes of metadata)..512MiB (a standby's snapshot carries the values), got "
                f"{self.inline_capacity}")
        require_token("--rpc-address", host_of(self.rpc_address), self.cluster_token)
        require(0 <= self.admin_port < 65536, f"--admin-port out of range: {self.admin_port}")
        require(bool(self.admin_host), "--admin-host must name an address, e.g. 127.0.0.1")
        require(self.election_ttl_s >= 1, f"--election-ttl-s must be >= 1, got {self.election_ttl_s}")
        _seconds("--repl-timeout-s", self.repl_timeout_s)
        require(not self.etcd or self.etcd.startswith(("http://", "https://")),
                f"--etcd must be an URL like http://127.0.0.1:2379, got {self.etcd!r}")


def _seconds(flag: str, v: float, zero_ok: bool = False) -> None:
    """A duration must be a finite number of seconds (an infinite one would, e.g., quarantine
    a revoked put's space forever), > 0 unless ``zero_ok``."""
    low_ok = v >= 0 if zero_ok else v > 0
    require(low_ok and v < 1e9, f"{flag} must be a finite number of seconds "
            f"{'>= 0' if zero_ok else '> 0'}, got {v}")


@dataclass(frozen=True)
class ClientConfig:
    """A store client (also used by nodes for their master session)."""

    master: str = field(default="tcp://127.0.0.1:50151", metadata={
        "help": "master RPC address(es), comma-separated; the client follows the leader"})
    client_id: str = field(default="", metadata={"help": "session id ('' = generated)"})
    rpc_timeout_s: float = field(default=5.0, metadata={"help": "per-call RPC timeout"})
    heartbeat_s: float = field(default=1.0, metadata={"help": "heartbeat period"})
    replicas: int = field(default=1, metadata={"help": "default replica count of a put"})
    placement: str = field(default="", metadata={
        "help": "default placement strategy ('' = the master's)"})
    preferred: tuple[str, ...] = field(default=(), metadata={
        "help": "preferred segment names for placement"})
    local_segment: str = field(default="", metadata={
        "help": "segment name that local_first placement prefers"})
    checksum: bool = field(default=True, metadata={
        "help": "store a CRC32 with each value and verify it on read"})
    transfer_timeout_s: float = field(default=30.0, metadata={"help": "data transfer timeout"})
    failover_s: float = field(default=15.0, metadata={
        "help": "how long a call keeps retrying other masters before giving up"})
    direct: bool = field(default=True, metadata={
        "help": "copy to/from a same-host node's shared-memory segment directly (no transfer "
                "engine batch); off: every byte goes through the engine"})
    spin_us: int = field(default=AUTO, metadata={
        "help": "poll this many microseconds for a master reply before sleeping for it (a "
                "wake-up from sleep costs ~6-20 us on a VM); 0 = always sleep; -1 (default) = "
                f"chosen for this machine at start-up ({CLIENT_SPIN_REF_US} us on the reference "
                "core, scaled by this core's measured speed; 0 on one CPU or where wake-ups "
                "are cheap)"})
    keep_freed: int = field(default=0, metadata={
        "help": "glibc mallopt for the WHOLE process, never undone: blocks up to 32 MiB come "
                "from the heap and up to this many bytes of freed heap top are kept, so the "
                "values get/batch_get return land in already-faulted pages (RSS then stays "
                "near its high-water mark, also for other components in the process); "
                "0 (default) leaves malloc alone; `yuebing bench store` uses 1GiB",
                "size": True})
    reserve_ahead: bool = field(default=True, metadata={
        "help": "puts of a shape put before (size, replicas, placement) ask the master to "
                "reserve space for the next one; that next put is then a write into it plus "
                "one commit RPC (one RPC instead of two); off: every put is two-phase"})
    commit_on_landing: bool = field(default=True, metadata={
        "help": "a put into a reservation on another host sends its commit with the write: the "
                "node hands it to the master once the bytes landed and the master answers this "
                "client, with no commit round trip of its own (blocking client; off: the "
                "commit RPC after the write)"})
    local_socket: bool = field(default=True, metadata={
        "help": "reach a master dialed on loopback through its Unix socket, not TCP (off: TCP, "
                "as a client on another host would)"})
    landing_wait_s: float = field(default=0.2, metadata={
        "help": "with --commit-on-landing, how long a put waits for the master's answer to the "
                "commit that rode on its write before sending the commit itself (a node's "
                "report lost, e.g. at a failover; the master answers the resent commit OK)"})
    inline_max_bytes: int = field(default=INLINE_MAX_BYTES, metadata={
        "help": "a put of at most this many bytes (one replica, no placement asked for) asks "
                "the master to hold the value itself: one RPC instead of a write and a commit; "
                "the master's own --inline-max-bytes decides; 0 = never ask", "size": True})
    put_retries: int = field(default=1, metadata={
        "help": "times a put whose write failed is placed again (the master avoids the "
                "segments that failed)"})

    def __post_init__(self) -> None:
        require(self.put_retries >= 0, f"--put-retries must be >= 0, got {self.put_retries}")
        require(AUTO <= self.spin_us <= 100_000,
                f"--spin-us must be in 0..100000 or -1 (auto), got {self.spin_us}")
        require(self.keep_freed >= 0, f"--keep-freed must be >= 0 bytes, got {self.keep_freed}")
        require(self.inline_max_bytes >= 0,
                f"--inline-max-bytes must be >= 0 bytes, got {self.inline_max_bytes}")
        require(bool(self.masters), "--master needs at least one address like tcp://127.0.0.1:50151")
        _seconds("--rpc-timeout-s", self.rpc_timeout_s)
        _seconds("--heartbeat-s", self.heartbeat_s)
        _seconds("--landing-wait-s", self.landing_wait_s, zero_ok=True)
        require(self.replicas >= 1, f"--replicas must be >= 1, got {self.replicas}")
        require(self.placement in ("", *PLACEMENTS),
                f"--placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        require(0 < self.transfer_timeout_s < 1e9,
                f"--transfer-timeout-s must be a finite number of seconds > 0, got {self.transfer_timeout_s}")
        require(self.failover_s >= 0, "--failover-s must be >= 0")

    @property
    def masters(self) -> list[str]:
        return [a.strip() for a in self.master.split(",") if a.strip()]


@dataclass(frozen=True)
class NodeConfig:
    """A storage node contributing a DRAM segment and optionally an SSD tier."""

    dram: int = field(default=1 << 30, metadata={
        "help": "DRAM segment size (shared memory), e.g. 4GiB", "size": True})
    ssd: str = field(default="", metadata={
        "help": "SSD tier as DIR:SIZE, e.g. /mnt/nvme/yuebing:100GiB ('' = none)"})
    name: str = field(default="", metadata={"help": "segment name prefix ('' = generated)"})
    prefault: bool = field(default=True, metadata={
        "help": "touch every page of the DRAM segment at start (no page faults mid-transfer)"})
    admin_host: str = field(default="127.0.0.1", metadata={
        "help": "address the admin HTTP binds (127.0.0.1: this host only)"})
    admin_port: int = field(default=0, metadata={
        "help": "admin HTTP port (/health /metrics); 0 = off"})
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata={
        "help": "the cluster token the master requires (its --cluster-token; default: "
                "$YUEBING_CLUSTER_TOKEN)", "secret": True})

    def __post_init__(self) -> None:
        require(self.dram > 0, f"--dram must be > 0, got {self.dram}")
        require(0 <= self.admin_port < 65536, f"--admin-port out of range: {self.admin_port}")
        require(bool(self.admin_host), "--admin-host must name an address, e.g. 127.0.0.1")
        if self.ssd:
            require(":" in self.ssd, f"--ssd must be DIR:SIZE, got {self.ssd!r}")
            self.ssd_dir_size  # noqa: B018 - parses and validates SIZE

    @property
    def ssd_dir_size(self) -> tuple[str, int] | None:
        if not self.ssd:
            return None
        from yuebing.core.config import parse_size

        path, _, size = self.ssd.rpartition(":")
        n = parse_size(size)
        require(bool(path) and n > 0, f"--ssd must be DIR:SIZE with SIZE > 0, got {self.ssd!r}")
        return path, n
