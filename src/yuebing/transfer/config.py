"""Configuration of one transfer engine (`TransferConfig`), validated on construction."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from yuebing.core.config import require
from yuebing.core.spin import AUTO

TRANSPORT_NAMES = ("shm", "tcp")
SPIN_REF_US = 50
"""The inline path's spin window on the reference core (`core.spin.window_s`)."""


def default_host_id() -> str:
    """Identity of this machine's memory domain: hostname + kernel boot id, so two processes
    agree on it exactly when they can map each other's /dev/shm files."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class TransferConfig:
    """Knobs of a `TransferEngine`; every field is also a ``yuebing`` CLI flag."""

    host: str = field(default="127.0.0.1", metadata={"help": "address the TCP listener binds"})
    port: int = field(default=0, metadata={"help": "listener port (0 = any free port)"})
    advertise_host: str = field(default="", metadata={
        "help": "address peers use to reach this engine (default: --host)"})
    host_id: str = field(default_factory=default_host_id, metadata={
        "help": "machine identity; equal ids on both ends enable the shared-memory transport"})
    transports: tuple[str, ...] = field(default=TRANSPORT_NAMES, metadata={
        "help": "transports in order of preference (shm, tcp)"})
    lanes: int = field(default=AUTO, metadata={
        "help": "persistent TCP connections per peer; -1 (default) = measured once per machine "
                "over loopback and kept (transfer.lanes; the engine logs its choice)"})
    slice_size: int = field(default=1 << 20, metadata={
        "help": "requests are cut into slices of at most this many bytes", "size": True})
    timeout_s: float = field(default=30.0, metadata={"help": "default deadline of a batch"})
    connect_timeout_s: float = field(default=5.0, metadata={
        "help": "TCP connect/handshake timeout (a timed-out handshake is tried once more)"})
    io_timeout_s: float = field(default=30.0, metadata={
        "help": "a socket send/recv stalled this long fails its lane"})
    write_grace_s: float = field(default=1.0, metadata={
        "help": "a target stops receiving an accepted write frame this long after the frame's "
                "expiry (the sender's batch deadline) and closes the connection: the store's "
                "master keeps a revoked put's space out of use for at least this plus its "
                "--fence-s, so late bytes never land in reallocated space"})
    max_retries: int = field(default=2, metadata={
        "help": "times a failed slice is retried on another lane"})
    retry_backoff_s: float = field(default=0.01, metadata={
        "help": "first retry delay; doubles on each further retry"})
    max_endpoints: int = field(default=64, metadata={
        "help": "cap of open peer endpoints (SIEVE eviction beyond it)"})
    socket_buffer: int = field(default=4 << 20, metadata={
        "help": "SO_SNDBUF/SO_RCVBUF of every lane (0 = kernel auto-tuning)", "size": True})
    max_frame_bytes: int = field(default=64 << 20, metadata={
        "help": "most payload bytes one TCP lane frame may move (a write's bytes, or what a "
                "read asks back); this engine splits its own frames at it and closes a "
                "connection whose peer announces a larger one (give peers the same value)",
        "size": True})
    inline_bytes: int = field(default=4 << 20, metadata={
        "help": "a batch submitted with inline=True moves over a dedicated TCP connection in "
                "the submitting thread (no lane threads) when its part for one peer is one "
                "direction and at most this many bytes; 0 = never", "size": True})
    spin_us: int = field(default=AUTO, metadata={
        "help": "the inline path polls this many microseconds for an answer before sleeping "
                "(a wake-up from sleep costs ~6-20 us on a VM); 0 = always sleep; -1 (default) "
                f"= chosen for this machine at start-up ({SPIN_REF_US} us on the reference core, "
                "scaled by this core's measured speed; 0 on one CPU or where wake-ups are cheap)"})
    shm_workers: int = field(default=1, metadata={"help": "copy threads per shared-memory peer"})
    shm_dir: str = field(default="/dev/shm", metadata={"help": "directory of shm segment files"})
    metadata: str = field(default="embedded", metadata={
        "help": "segment directory: embedded | p2p | etcd://HOST:PORT[,HOST:PORT]"})
    engine_id: str = field(default="", metadata={"help": "name of this engine (default: random)"})

    def __post_init__(self) -> None:
        require(bool(self.host), "host must not be empty (e.g. 127.0.0.1)")
        require(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        require(bool(self.host_id), "host_id must not be empty")
        require(len(self.transports) > 0 and all(t in TRANSPORT_NAMES for t in self.transports),
                f"transports must be a non-empty subset of {TRANSPORT_NAMES}, got {self.transports}")
        require(self.lanes == AUTO or 1 <= self.lanes <= 64,
                f"lanes must be in 1..64 or -1 (chosen for this machine), got {self.lanes}")
        require(4096 <= self.slice_size <= 1 << 30,
                f"slice_size must be in 4KiB..1GiB, got {self.slice_size}")
        for name in ("timeout_s", "connect_timeout_s", "io_timeout_s"):
            v = getattr(self, name)
            require(0 < v < 1e9, f"{name} must be a finite number of seconds > 0, got {v}")
        require(0 <= self.write_grace_s <= 60,
                f"write_grace_s must be in 0..60 seconds, got {self.write_grace_s}")
        require(0 <= self.max_retries <= 16, f"max_retries must be in 0..16, got {self.max_retries}")
        require(self.retry_backoff_s >= 0, f"retry_backoff_s must be >= 0, got {self.retry_backoff_s}")
        require(self.max_endpoints >= 1, f"max_endpoints must be >= 1, got {self.max_endpoints}")
        require(self.socket_buffer == 0 or self.socket_buffer >= 65536,
                f"socket_buffer must be 0 (auto) or >= 64KiB, got {self.socket_buffer}")
        require(self.slice_size <= self.max_frame_bytes <= 1 << 32,
                f"max_frame_bytes must be in slice_size ({self.slice_size})..4GiB, "
                f"got {self.max_frame_bytes}")
        require(0 <= self.inline_bytes <= self.max_frame_bytes,
                f"inline_bytes must be in 0..max_frame_bytes ({self.max_frame_bytes}), "
                f"got {self.inline_bytes}")
        require(AUTO <= self.spin_us <= 100_000,
                f"spin_us must be in 0..100000 or -1 (auto), got {self.spin_us}")
        require(1 <= self.shm_workers <= 16, f"shm_workers must be in 1..16, got {self.shm_workers}")
        require(os.path.isdir(self.shm_dir), f"shm_dir {self.shm_dir!r} is not a directory")
        require(self.metadata in ("embedded", "p2p") or self.metadata.startswith("etcd://"),
                f"metadata must be embedded, p2p or etcd://HOST:PORT, got {self.metadata!r}")
        require("/" not in self.engine_id, f"engine_id must not contain '/', got {self.engine_id!r}")

    @property
    def public_host(self) -> str:
        return self.advertise_host or self.host
