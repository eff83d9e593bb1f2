"""`InstanceConfig`: what an operator sets for one serving instance (every field a CLI flag of
``yuebing serve prefill|decode|coupled``; the engine's own knobs are its `EngineConfig`'s,
``ENGINE_FLAGS`` of them offered as flags). Built by the CLI or `yuebing.cluster`; read by
`instance.base.Instance` and the role modules."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from yuebing.core.auth import TOKEN_HELP, env_cluster_token, require_token
from yuebing.core.config import require
from yuebing.engine.config import EngineConfig, parse_layers
from yuebing.ops.priority import IDLE_HELP, NICE_HELP, EnginePriority

ROLES = ("prefill", "decode", "coupled")
EVENT_LOOPS = ("uvloop", "asyncio")
ENGINE_FLAGS = ("model", "num_blocks", "kv_cache_bytes", "max_num_seqs", "max_batch_tokens",
                "max_model_len", "dtype", "device", "threads", "attention", "kernels",
                "prefill_attention", "weights_seed", "batch_invariant", "layers", "fused_decode",
                "amx_linear", "mixed_step_s")
"""The `EngineConfig` fields an instance offers as its own flags (same names)."""
DEFAULT_ENGINE = EngineConfig(device="cpu", threads=1, kv_cache_bytes=512 << 20)
"""An instance's engine unless flags say otherwise: CPU, one thread, a 512 MiB KV pool."""


@dataclass(frozen=True)
class InstanceConfig:
    role: str = field(default="coupled", metadata={"help": "prefill, decode or coupled"})
    instance_id: str = field(default="", metadata={
        "help": "name in the cluster ('' = role + host + port)"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "address the control server and the transfer engine bind"})
    advertise_host: str = field(default="", metadata={
        "help": "address peers use to reach this instance ('' = --host)"})
    control_port: int = field(default=0, metadata={"help": "control server port (0 = any)"})
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata={
        "help": TOKEN_HELP + "; required on the control socket, sent to peers and the store",
        "secret": True})
    admin_host: str = field(default="127.0.0.1", metadata={
        "help": "address the admin HTTP (/health /metrics) binds (127.0.0.1: this host only)"})
    admin_port: int = field(default=0, metadata={"help": "admin HTTP port (0 = off)"})
    engine: EngineConfig = field(default_factory=lambda: DEFAULT_ENGINE, metadata={
        "flags": ENGINE_FLAGS})
    """The engine's configuration; its ``ENGINE_FLAGS`` fields are flags of the instance."""
    cpp_group: str = field(default="", metadata={
        "help": "with --layers: the pipeline group this stage belongs to; the Conductor routes "
                "long prompts to a group once stages of one name cover every layer (with "
                "--twin-of: the group of the stage this whole-model instance twins)"})
    twin_of: str = field(default="", metadata={
        "help": "with --cpp-group, on a whole-model prefill instance: the layer range A:B of "
                "the group's stage on this machine; it shares that stage's Conductor gate and "
                "gets short prompts while the group has no work ('' = not a twin)"})
    lend_cores: bool = field(default=True, metadata={
        "help": "lend this instance's cores to the other instances of this host while it is "
                "idle, and borrow theirs while they are (a shared-memory ledger in /dev/shm; "
                "each step runs with its own threads plus the idle instances', at most the "
                "cores it may use; not with --batch-invariant: a step's bits depend on its "
                "thread count)"})
    step_trace_dir: str = field(default="", metadata={
        "help": "append one JSON line per engine step (start, engine seconds, batch) to "
                "DIR/<instance-id>.steps.jsonl ('' = off; for profiling a live run)"})
    store_master: str = field(default="", metadata={
        "help": "store master address(es) ('' = no KV pool: local prefix cache only)"})
    store_block_tokens: int = field(default=256, metadata={"help": "tokens per store object"})
    staging_bytes: int = field(default=256 << 20, metadata={
        "help": "registered staging memory for store loads/saves", "size": True})
    store_load_timeout_s: float = field(default=2.0, metadata={
        "help": "a prefix load from the store gives up on each store master call (the prefix "
                "lookup, the replica request) after this many seconds, tries and failover "
                "included, and the prefix is computed instead: a load is on the request's TTFT "
                "path, so it does not wait out the store client's failover budget (15 s) for "
                "a master that does not answer. Saves keep that budget, on a thread of their "
                "own"})
    save_to_store: bool = field(default=True, metadata={
        "help": "save new prefill blocks to the store"})
    host_id: str = field(default="", metadata={
        "help": "host identity for the transfer engine ('' = this machine's); another value "
                "makes same-host peers use TCP (tests, benchmarks)"})
    report_hz: float = field(default=10.0, metadata={"help": "load reports per second"})
    reserve_timeout_s: float = field(default=300.0, metadata={
        "help": "decode: the longest a reservation waits for its KV (the Conductor asks for "
                "less per request) before it is dropped"})
    kv_headroom_blocks: int = field(default=0, metadata={
        "help": "decode: refuse a reservation that would leave fewer free blocks (room for "
                "the running batch to grow without preemption)"})
    transfer_timeout_s: float = field(default=30.0, metadata={"help": "KV transfer timeout"})
    layerwise_min_bytes: int = field(default=256 << 10, metadata={
        "help": "prefill: a chunk whose KV per layer is smaller goes to the decode in one "
                "transfer after its last layer instead of one per layer (0 = always layer by "
                "layer)", "size": True})
    etcd: str = field(default="", metadata={
        "help": "etcd URL: publish this instance for discovery ('' = none)"})
    cluster: str = field(default="default", metadata={"help": "cluster name in etcd"})
    ready_file: str = field(default="", metadata={
        "help": "write this instance's Hello as JSON here once ready"})
    warmup: bool = field(default=True, metadata={"help": "one tiny forward pass at start"})
    startup_profile: bool = field(default=True, metadata={
        "help": "time the engine on a grid of prompts / batches at start and send it to the "
                "Conductors, which fit their predictors to it (cached per configuration and "
                "machine under ~/.cache/yuebing/profiles: only a first start pays)"})
    engine_nice: int = field(default=10, metadata={"help": NICE_HELP})
    engine_idle: bool = field(default=False, metadata={"help": IDLE_HELP})
    event_loop: str = field(default="uvloop", metadata={
        "help": "the control loop's implementation: uvloop (less CPU per message) or asyncio"})

    def __post_init__(self) -> None:
        require(self.role in ROLES, f"role must be one of {', '.join(ROLES)}, got {self.role!r}")
        require(0 <= self.control_port < 65536, f"control_port must be 0..65535, got "
                f"{self.control_port}")
        require(0 <= self.admin_port < 65536, f"admin_port must be 0..65535, got "
                f"{self.admin_port}")
        require(bool(self.admin_host), "admin_host must name an address, e.g. 127.0.0.1")
        require_token("--host", self.host, self.cluster_token)
        require(not self.engine.layers or self.role == "prefill", f"--layers "
                f"{self.engine.layers}: only a prefill instance runs a layer range (a pipeline "
                f"stage), not a {self.role} one")
        require(not self.cpp_group or bool(self.engine.layers) or bool(self.twin_of),
                f"--cpp-group {self.cpp_group}: a group's stages each run a layer range "
                f"(--layers A:B); a whole-model twin names its stage (--twin-of A:B)")
        if self.twin_of:
            require(bool(self.cpp_group) and not self.engine.layers and self.role == "prefill",
                    f"--twin-of {self.twin_of}: a twin is a whole-model prefill instance (no "
                    f"--layers) of a pipeline group (--cpp-group NAME)")
            parse_layers(self.twin_of, None)
        require(self.engine.threads >= 1, f"threads must be >= 1, got {self.engine.threads}")
        EnginePriority(self.engine_nice, self.engine_idle)  # refuses a bad --engine-nice
        if self.step_trace_dir:
            d = Path(self.step_trace_dir)
            existing = next(p for p in (d, *d.absolute().parents) if p.exists())
            require(existing.is_dir() and os.access(existing, os.W_OK | os.X_OK),
                    f"--step-trace-dir {self.step_trace_dir!r}: '{existing}' is not a writable "
                    f"directory")
        require(self.report_hz > 0, f"report_hz must be > 0, got {self.report_hz}")
        require(self.store_block_tokens > 0 and self.store_block_tokens % 16 == 0,
                f"store_block_tokens must be a positive multiple of 16, got "
                f"{self.store_block_tokens}")
        require(self.reserve_timeout_s > 0, "reserve_timeout_s must be > 0")
        require(self.transfer_timeout_s > 0, "transfer_timeout_s must be > 0")
        require(self.kv_headroom_blocks >= 0, "kv_headroom_blocks must be >= 0")
        require(self.staging_bytes > 0, "staging_bytes must be > 0")
        require(self.store_load_timeout_s > 0, f"store_load_timeout_s must be > 0 seconds, "
                f"got {self.store_load_timeout_s}")
        require(self.layerwise_min_bytes >= 0, "layerwise_min_bytes must be >= 0")
        require(self.event_loop in EVENT_LOOPS, f"event_loop must be one of "
                f"{', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")

    @property
    def priority(self) -> EnginePriority:
        """This instance process's CPU priority (`ops.priority`, applied at its start)."""
        return EnginePriority(self.engine_nice, self.engine_idle)

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", ""):
            return socket.gethostname()
        return self.host
