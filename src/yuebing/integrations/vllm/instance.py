"""`VllmInstance`: a vLLM OpenAI server as a yuebing instance (role coupled, prefill or decode).

Started by ``yuebing vllm instance`` (`cli/cmd_vllm.py`, which may also start vLLM) and by
``yuebing serve --engine vllm``; the Conductor routes to it and relays its tokens as for its
own instances. A `SubmitTask` becomes a streamed ``/v1/completions`` of the prompt's token ids,
each chunk a `TaskEvent` (FIRST_TOKEN, TOKENS, FINISH); `Cancel` closes the stream. Hand-offs:
`_submit`, `_reserve`, `_kv_ready` over `handoff.Handoff`. The Conductor's prefix plan is not
followed: vLLM's `YuebingConnector` looks the prompt up in the store. Load reports come from
vLLM's ``/metrics`` every ``report_s``, with the keys its cache gained and lost (`KvEventIndex`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from yuebing.cluster.discovery import parse_etcd_url
from yuebing.core.auth import TOKEN_HELP, env_cluster_token, require_token
from yuebing.core.config import require
from yuebing.core.cpus import format_cpus, parse_cpus, require_usable, usable_cpus
from yuebing.integrations.vllm.events import KvEventIndex
from yuebing.integrations.vllm.handoff import Handoff
from yuebing.integrations.vllm.layout import KvLayout, layout_from_hf
from yuebing.integrations.vllm.load import VllmLoad, parse_metrics
from yuebing.integrations.vllm.plan import RECV_KEY, SEND_KEY, StreamParams
from yuebing.ops.priority import IDLE_HELP, NICE_HELP, EnginePriority
from yuebing.ops.zap import TokenAuthenticator, serve_plain
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol.instance import (
    Ack,
    Breakdown,
    Cancel,
    DecodeTarget,
    EngineProfile,
    ErrorCode,
    ErrorReply,
    EventKind,
    Hello,
    KvReady,
    KvStreamed,
    LoadReport,
    Ping,
    Reserve,
    Reserved,
    Role,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskEvent,
    TaskEvents,
    TaskMode,
)
from yuebing.protocol.instance import KvLayout as WireLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmInstanceConfig:
    vllm_url: str = field(default="", metadata={
        "help": "a running vLLM OpenAI server to relay to, e.g. http://127.0.0.1:8001 ('' = "
                "start one from the peers venv on --vllm-port, with the connector on --master)"})
    vllm_port: int = field(default=8001, metadata={"help": "port of the vLLM server started"})
    master: str = field(default="", metadata={
        "help": "store master of the started vLLM's YuebingConnector ('' = the store leader "
                "named in --etcd, else no connector)"})
    model_dir: str = field(default="", metadata={
        "help": "the HF model folder vLLM serves ('' = the peers venv's SmolLM2 export)"})
    instance_id: str = field(default="vllm-0", metadata={"help": "this instance's id"})
    host: str = field(default="127.0.0.1", metadata={
        "help": "control socket host (beyond loopback: a cluster token is required)"})
    cluster_token: str = field(default_factory=env_cluster_token, repr=False, metadata={
        "help": TOKEN_HELP, "secret": True})
    control_port: int = field(default=0, metadata={"help": "control socket port (0 = any)"})
    served_name: str = field(default="smollm2-135m-instruct", metadata={
        "help": "vLLM's --served-model-name (also the model's name in the KV fingerprint)"})
    dtype: str = field(default="float32", metadata={"help": "vLLM's --dtype"})
    block_size: int = field(default=128, metadata={"help": "vLLM's --block-size"})
    store_block_tokens: int = field(default=256, metadata={"help": "tokens per store block"})
    max_model_len: int = field(default=4352, metadata={"help": "vLLM's --max-model-len"})
    cpus: str = field(default="", metadata={
        "help": "the CPUs the started vLLM runs on, e.g. 1, 0-3 or 0,2-3 (its processes' "
                "affinity; its OpenMP threads are bound to them, one each). '' = every CPU this "
                "process may use; `yuebing serve --engine vllm` gives each instance its own "
                "share of the host's"})
    threads: int = field(default=0, metadata={
        "help": "the started vLLM's OpenMP threads, bound to the first of --cpus (0 = one per "
                "CPU of --cpus; part of the configuration its start-up profile holds for)"})
    lend_cores: bool = field(default=False, metadata={
        "help": "opt-in, for two vLLM instances alone on a host: with --cpus narrower than the "
                "CPUs this process may use, the started vLLM runs on all of those, steps with "
                "--threads of its own and borrows the cores no other instance of this host "
                "claims (yuebing's core ledger in /dev/shm); off: it keeps to --cpus. Off by "
                "default: it showed no step gain here (docs/serving.md, \"Lending cores\")"})
    accelerator: str = field(default="", metadata={
        "help": "with --vllm-url: what that vLLM runs on, e.g. '8x H100-80GB TP8' or 'Xeon "
                "8480 cpu 32 threads', the key its start-up profile is cached and shared "
                "under (required unless --no-startup-profile; '' without --vllm-url: the vLLM "
                "started here runs on this CPU with --threads)"})
    startup_profile: bool = field(default=True, metadata={
        "help": "time vLLM on a small grid of prompts / batches once it is up and send it to "
                "the Conductors, which fit their predictors to it (cached per configuration "
                "and machine under ~/.cache/yuebing/profiles: only a first start pays)"})
    engine_nice: int = field(default=10, metadata={
        "help": "the vLLM server started here (not one at --vllm-url, not this adapter): "
                + NICE_HELP})
    engine_idle: bool = field(default=False, metadata={"help": IDLE_HELP})
    etcd: str = field(default="", metadata={
        "help": "etcd URL: publish this instance for the Conductor's discovery, and find the "
                "store master there when --master is not given ('' = none)"})
    cluster: str = field(default="default", metadata={"help": "cluster name in etcd"})
    report_s: float = field(default=0.5, metadata={"help": "load report period"})
    role: str = field(default="coupled", metadata={
        "help": "coupled, prefill or decode (prefill/decode hand the KV off through the store)"})
    handoff_wait_s: float = field(default=5.0, metadata={
        "help": "prefill: how long to wait for the store to hold the prompt's blocks before "
                "telling the decode (it computes what is missing); decode: how long to wait "
                "for a layer-wise stream's end after KvReady before using the store"})
    kv_events_port: int = field(default=0, metadata={
        "help": "port on 127.0.0.1 this instance takes vLLM's KV-cache events on, for the "
                "Conductor's KV index; vLLM's publisher connects to it (--kv-events-config "
                "endpoint tcp://127.0.0.1:PORT). 0 = a free port when this instance starts "
                "vLLM, none with --vllm-url; -1 = none"})
    kv_replay_port: int = field(default=0, metadata={
        "help": "port on 127.0.0.1 of vLLM's KV-event replay endpoint (its ROUTER binds it), "
                "asked for the events lost in a gap; without one a gap resets this "
                "instance's part of the Conductor's index. 0 = a free port when this "
                "instance starts vLLM, none with --vllm-url; -1 = none"})
    replay_timeout_s: float = field(default=2.0, metadata={
        "help": "how long a replay of lost KV events may take before the index is reset"})
    handoff_pool_blocks: int = field(default=48, metadata={
        "help": "decode: vLLM blocks (of every layer) in the shared-memory pool that prefills "
                "stream the KV into layer by layer (0 = hand off through the store)"})

    def __post_init__(self) -> None:
        require(self.role in ("coupled", "prefill", "decode"),
                f"role must be coupled, prefill or decode, got {self.role!r}")
        require(not self.vllm_url or self.vllm_url.startswith("http"),
                f"vllm_url must be http(s)://host:port, got {self.vllm_url!r}")
        require(self.report_s > 0, "report_s must be > 0")
        require(self.threads >= 0, f"--threads must be >= 0 (0 = one per CPU of --cpus), "
                f"got {self.threads}")
        if self.cpus:
            require(not self.vllm_url, f"--cpus {self.cpus} names the CPUs of the vLLM started "
                    f"here; the one at --vllm-url {self.vllm_url} runs where it was started")
            require_usable(parse_cpus(self.cpus))
        if self.vllm_url:
            require(bool(self.accelerator.strip()) or not self.startup_profile,
                    f"--vllm-url {self.vllm_url}: name what that vLLM runs on with --accelerator "
                    "(e.g. '8x H100-80GB TP8': its start-up profile is cached under it, and "
                    "this host's CPU and --threads say nothing about it), or give "
                    "--no-startup-profile")
        else:
            require(not self.accelerator, f"--accelerator {self.accelerator!r} names the "
                    "hardware of a vLLM at --vllm-url; the vLLM started here runs on this CPU "
                    "(--cpus, --threads)")
            cpus = self.cpu_set()
            require(self.threads <= len(cpus),
                    f"--threads {self.threads}: vLLM binds each OpenMP thread to a CPU of its "
                    f"own, and --cpus {format_cpus(cpus)} has {len(cpus)}")
        require(self.handoff_pool_blocks >= 0, "handoff_pool_blocks must be >= 0")
        require(self.replay_timeout_s > 0, "replay_timeout_s must be > 0")
        EnginePriority(self.engine_nice, self.engine_idle)  # refuses a bad --engine-nice
        if self.etcd:
            try:
                parse_etcd_url(self.etcd)
            except ValueError as e:
                require(False, str(e))
        require_token("--host", self.host, self.cluster_token)
        for name in ("kv_events_port", "kv_replay_port"):
            port = getattr(self, name)
            require(-1 <= port < 65536, f"{name} must be -1, 0 or a port, got {port}")

    def cpu_set(self) -> tuple[int, ...]:
        """The CPUs the vLLM started here runs on (--cpus, else all this process may use)."""
        return parse_cpus(self.cpus) if self.cpus else usable_cpus()

    def lend_cpus(self) -> tuple[int, ...]:
        """The CPUs the started vLLM shares with the host's other instances, its own first
        (() = it keeps to `cpu_set`: --no-lend-cores, --vllm-url, or --cpus all it may use)."""
        if not self.lend_cores or self.vllm_url or not self.cpus:
            return ()
        own, usable = self.cpu_set(), usable_cpus()
        return usable if set(usable) - set(own) else ()

    @property
    def omp_threads(self) -> int:
        """The started vLLM's OpenMP threads (--threads, else one per CPU of `cpu_set`)."""
        return self.threads or len(self.cpu_set())

    @property
    def priority(self) -> EnginePriority:
        """The started vLLM server's CPU priority (`ops.priority`)."""
        return EnginePriority(self.engine_nice, self.engine_idle)

    def layout(self) -> KvLayout:
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return layout_from_hf(config, self.served_name, self.dtype, self.block_size,
                              self.store_block_tokens)


def completion_body(cfg: VllmInstanceConfig, token_ids: list[int], s: Sampling
                    ) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body for a prompt (refused with ValueError where vLLM's answer
    could not be relayed: several choices, logprobs)."""
    if s.n != 1 or s.logprobs is not None:
        raise ValueError("a vLLM instance relays one choice without logprobs (n=1)")
    body: dict[str, Any] = {
        "model": cfg.served_name, "prompt": list(token_ids), "max_tokens": s.max_tokens,
        "temperature": s.temperature, "top_p": s.top_p, "stream": True,
        "return_token_ids": True, "ignore_eos": s.ignore_eos, "min_tokens": s.min_tokens,
        "stream_options": {"include_usage": True}}
    if s.top_k > 0:
        body["top_k"] = s.top_k
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = list(s.stop)
    if s.stop_token_ids:
        body["stop_token_ids"] = list(s.stop_token_ids)
    return body


def vllm_queue_s(chunk: dict[str, Any]) -> float | None:
    """vLLM's queue time for the request, seconds, from a stream's usage chunk
    (``metrics.queue_time_ms``: ``--enable-per-request-metrics``); None where it has none."""
    metrics = chunk.get("metrics")
    ms = metrics.get("queue_time_ms") if isinstance(metrics, dict) else None
    return max(0.0, float(ms)) / 1e3 if isinstance(ms, int | float) else None


class HandoffError(RuntimeError):
    """The prefill could not tell its decode that the KV is ready."""


ROLES = {"coupled": Role.COUPLED, "prefill": Role.PREFILL, "decode": Role.DECODE}


class VllmInstance:
    """The control socket, the relayed tasks, the reservations (decode), the hand-off
    (`handoff.Handoff`: prefill, decode) and the load reports of one vLLM server."""

    def __init__(self, cfg: VllmInstanceConfig, engine: dict[str, str] | None = None,
                 profile: EngineProfile | None = None) -> None:
        self.cfg = cfg
        self.layout = cfg.layout()
        self.engine = engine or {"engine": "vllm", "model": cfg.served_name, "dtype": cfg.dtype,
                                 "block_size": str(cfg.block_size)}
        """The configuration the Conductor's predictors must hold for (`profile.signature`)."""
        self.profile = profile
        """Its start-up profile (`profile.vllm_profile`), sent in `Hello`; None: none."""
        hf = json.loads((Path(cfg.model_dir) / "config.json").read_text())
        eos = hf.get("eos_token_id")
        self.eos = set(eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else [])
        self.incarnation = uuid.uuid4().hex
        self.ctx = zmq.asyncio.Context()
        self.zap: TokenAuthenticator | None = None
        if cfg.cluster_token:  # only peers presenting the token (`ops.zap`)
            self.zap = TokenAuthenticator(self.ctx, cfg.cluster_token)
            self.zap.start()
        self.sock = self.ctx.socket(zmq.ROUTER)
        if cfg.cluster_token:
            serve_plain(self.sock)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{cfg.host}") if cfg.control_port == 0 \
            else self._bind(cfg.control_port)
        self.address = f"tcp://{cfg.host}:{port}"
        self.subscribers: set[bytes] = set()
        self.tasks: dict[str, tuple[bytes, asyncio.Task[None]]] = {}
        self.reserved: dict[str, tuple[bytes, Reserve, float]] = {}
        """Decode: reservations waiting for their `KvReady` (connection, request, deadline)."""
        self.pool_held: dict[str, list[int]] = {}
        """Decode: receive-pool blocks per request, until its vLLM has read them."""
        self.pool_expiry: dict[str, float] = {}
        """Decode: when each request's reservation expires (wall clock): a prefill writes
        into its blocks until shortly before, never after."""
        self.quarantined: list[tuple[float, list[int]]] = []
        """Decode: blocks released while their prefill may still be writing into them, and
        when they are safe to reuse (`sweep` gives them back)."""
        self.streamed: dict[str, KvStreamed] = {}
        """Decode: `KvStreamed` of requests whose `KvReady` has not come yet."""
        self.stream_waits: dict[str, asyncio.Future[KvStreamed]] = {}
        self.load = VllmLoad()
        self.kv_index = KvEventIndex(self.layout)
        self.kv_sub: zmq.asyncio.Socket | None = None
        self.resync = True
        """The next report carries every key held (`cache_full_resync`): the first one, and
        the first after a (re-)subscription, which is how the Conductor asks for one."""
        self.report_seq = 0
        self.http: aiohttp.ClientSession | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handoff: Handoff | None = None
        if cfg.role != "coupled":
            blocks = cfg.handoff_pool_blocks if cfg.role == "decode" else 0
            self.handoff = Handoff(cfg.host, self.layout, cfg.master, cfg.handoff_wait_s,
                                   on_ready=self._notified, pool_blocks=blocks,
                                   on_streamed=self._streamed_notified)

    def _bind(self, port: int) -> int:
        self.sock.bind(f"tcp://{self.cfg.host}:{port}")
        return port

    def hello(self, seq: int) -> Hello:
        """Carries the fingerprint of this instance's `KvLayout` (from the model's
        ``config.json``), so the Conductor refuses an instance whose model, dtype or block size
        differs from the cluster's, naming both; and the vLLM configuration (``engine``) and
        start-up profile the Conductor's predictors are fitted to and checked against."""
        segment = self.handoff.segment if self.handoff and self.cfg.role == "decode" else ""
        return Hello(seq=seq, instance_id=self.cfg.instance_id, role=ROLES[self.cfg.role],
                     model=self.cfg.served_name, fingerprint=self.layout.fingerprint(),
                     host=self.cfg.host, control_address=self.address, kv_segment=segment,
                     block_size=self.cfg.block_size,
                     store_block_tokens=self.cfg.store_block_tokens,
                     num_blocks=self.load.total_blocks, max_model_len=self.cfg.max_model_len,
                     incarnation=self.incarnation, engine=dict(self.engine),
                     profile=self.profile)

    # ------------------------------------------------------------------ control
    async def serve(self) -> None:
        """Answer control messages and send load reports until cancelled."""
        self.loop = asyncio.get_running_loop()
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        reports = self.loop.create_task(self._reports())
        events = None
        if self.cfg.kv_events_port > 0:
            self.kv_sub = self.ctx.socket(zmq.SUB)
            self.kv_sub.setsockopt(zmq.LINGER, 0)
            self.kv_sub.setsockopt(zmq.SUBSCRIBE, b"")
            # vLLM's publisher connects here (it binds only wildcard endpoints)
            self.kv_sub.bind(f"tcp://127.0.0.1:{self.cfg.kv_events_port}")
            events = self.loop.create_task(self._kv_events(self.kv_sub))
        try:
            while True:
                ident, frame = await self.sock.recv_multipart()
                try:
                    msg = decode(frame)
                except ProtocolError as e:
                    log.warning("bad control frame: %s", e)
                    continue
                try:
                    reply = self.dispatch(ident, msg)
                except Exception as e:  # noqa: BLE001 - one bad request never ends the instance
                    log.exception("handling %s failed", type(msg).__name__)
                    reply = ErrorReply(seq=getattr(msg, "seq", 0), code=ErrorCode.INTERNAL,
                                       message=f"{type(e).__name__}: {e}")
                if reply is not None:
                    await self.sock.send_multipart([ident, encode(reply)])
        finally:
            reports.cancel()
            if events is not None and self.kv_sub is not None:
                events.cancel()
                self.kv_sub.close()  # before the context ends (the task has not run yet)
            for _, job in list(self.tasks.values()):
                job.cancel()
            await self.http.close()
            if self.handoff is not None:
                self.handoff.close()
            self.sock.close()
            if self.zap is not None:
                self.zap.stop()
            self.ctx.term()

    def dispatch(self, ident: bytes, msg: Message) -> Message | None:
        seq = getattr(msg, "seq", 0)
        if isinstance(msg, Subscribe):
            self.subscribers.add(ident)
            self.resync = True
            return self.hello(seq)
        if isinstance(msg, Ping):
            return Ack(seq=seq)
        if isinstance(msg, Cancel):
            found = self.tasks.pop(msg.request_id, None)
            if found is not None:
                found[1].cancel()
            elif self.reserved.pop(msg.request_id, None) is None:
                return ErrorReply(seq=seq, code=ErrorCode.UNKNOWN_TASK,
                                  message=f"no task {msg.request_id}")
            self._release(msg.request_id)
            return Ack(seq=seq)
        if isinstance(msg, SubmitTask):
            return self._submit(ident, msg)
        if isinstance(msg, Reserve) and self.cfg.role == "decode":
            return self._reserve(ident, msg)
        return ErrorReply(seq=seq, code=ErrorCode.BAD_REQUEST, message=(
            f"a {self.cfg.role} vLLM instance does not take {type(msg).__name__}"))

    def _submit(self, ident: bytes, msg: SubmitTask) -> Message:
        """Acknowledge and relay to vLLM. Prefill: ``max_tokens`` 1 and, with pool blocks of a
        decode of the same layout, ``yuebing_send`` (its vLLM streams the KV into them layer by
        layer: `stream`); the first token then goes to the decode in `KvReady` (`_hand_off`)."""
        mode_ok = (msg.mode == TaskMode.COUPLED and self.cfg.role != "decode") or (
            msg.mode == TaskMode.PREFILL and self.cfg.role == "prefill" and msg.decode)
        if not mode_ok:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST, message=(
                f"a {self.cfg.role} vLLM instance does not run {msg.mode.name} tasks"
                + ("" if msg.decode or msg.mode != TaskMode.PREFILL else " without a decode")))
        if msg.request_id in self.tasks:
            return ErrorReply(seq=msg.seq, code=ErrorCode.DUPLICATE,
                              message=f"task {msg.request_id} exists")
        s = msg.sampling
        if msg.mode == TaskMode.PREFILL:  # the first token here, the rest at the decode
            s = msgspec.structs.replace(s, max_tokens=1, min_tokens=0)
        try:
            body = completion_body(self.cfg, list(msg.token_ids), s)
        except ValueError as e:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST, message=str(e))
        target = msg.decode
        if target is not None and target.blocks and \
                target.layout.fingerprint == self.layout.fingerprint():
            body["kv_transfer_params"] = {SEND_KEY: StreamParams(
                msg.request_id, target.segment, target.layout.num_blocks, tuple(target.blocks),
                len(msg.token_ids), target.expires_at_s).to_params()}
        self._start(ident, msg.request_id, body, len(msg.token_ids), 0, msg.decode)
        return Ack(seq=msg.seq)

    def _start(self, ident: bytes, rid: str, body: dict[str, Any], n: int, outputs: int,
               target: DecodeTarget | None = None) -> None:
        assert self.loop is not None
        job = self.loop.create_task(self._relay(ident, rid, body, n, outputs, target))
        self.tasks[rid] = (ident, job)

    # ------------------------------------------------------------------ decode
    def _reserve(self, ident: bytes, msg: Reserve) -> Message:
        """Decode: answer with blocks of the receive pool (none when it lacks them: the KV then
        goes through the store) and keep the request until its `KvReady`."""
        assert self.handoff is not None
        if len(msg.token_ids) != msg.prompt_tokens or not msg.timeout_s > 0:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST, message=(
                f"prompt_tokens={msg.prompt_tokens} with {len(msg.token_ids)} token ids, "
                f"timeout_s={msg.timeout_s}"))
        try:
            completion_body(self.cfg, list(msg.token_ids), msg.sampling)
        except ValueError as e:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST, message=str(e))
        if msg.request_id in self.reserved or msg.request_id in self.tasks:
            return ErrorReply(seq=msg.seq, code=ErrorCode.DUPLICATE,
                              message=f"request {msg.request_id} exists")
        self.reserved[msg.request_id] = (ident, msg, time.monotonic() + msg.timeout_s)
        blocks = self.handoff.take(msg.prompt_tokens)
        if blocks:
            self.pool_held[msg.request_id] = blocks
            self.pool_expiry[msg.request_id] = time.time() + msg.timeout_s
        lay, pool = self.layout, self.handoff.pool
        return Reserved(seq=msg.seq, target=DecodeTarget(
            instance_id=self.cfg.instance_id, segment=self.handoff.segment, blocks=blocks,
            layout=WireLayout(num_layers=lay.layers, num_blocks=pool.num_blocks,
                              block_size=self.cfg.block_size, chunk_bytes=pool.block_bytes,
                              fingerprint=lay.fingerprint()),
            expires_at_s=time.time() + msg.timeout_s))

    def _release(self, rid: str, settled: bool = False) -> None:
        """Decode: the request no longer needs its pool blocks. They are free again at once
        when its stream is ``settled`` (its `KvStreamed` came: the prefill writes no more) or
        its reservation has expired; else they wait in `quarantined` until it expires, so a
        late write cannot land in another request's KV."""
        blocks = self.pool_held.pop(rid, None)
        expiry = self.pool_expiry.pop(rid, 0.0)
        settled = settled or self.streamed.pop(rid, None) is not None
        if blocks and self.handoff is not None:
            if settled or time.time() >= expiry:
                self.handoff.give_back(blocks)
            else:
                self.quarantined.append((expiry, blocks))

    def _streamed_notified(self, msg: KvStreamed) -> None:
        """Transfer-engine thread: a prefill's vLLM finished streaming a request's KV."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._streamed, msg)

    def _streamed(self, msg: KvStreamed) -> None:
        wait = self.stream_waits.pop(msg.request_id, None)
        if wait is not None and not wait.done():
            wait.set_result(msg)
        elif msg.request_id in self.pool_held:
            self.streamed[msg.request_id] = msg

    def _notified(self, msg: KvReady) -> None:
        """Transfer-engine thread: a prefill's `KvReady`."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._kv_ready, msg)

    def _kv_ready(self, msg: KvReady) -> None:
        """Decode: relay the rest of the answer, asked with the prompt plus the first token
        (reading the pool once it holds the KV: `_continue`; else from the store)."""
        found = self.reserved.pop(msg.request_id, None)
        if found is None:
            log.info("KvReady for unknown request %s ignored", msg.request_id)
            return
        ident, res, _ = found
        rid, n, s = res.request_id, len(res.token_ids), res.sampling
        if not msg.ok:
            self._release(rid)
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.ERROR,
                                         error_code=ErrorCode.TRANSFER,
                                         error=f"the prefill failed: {msg.error}"))
            return
        first = msg.first_token
        if s.max_tokens <= 1 or (first in self.eos and not s.ignore_eos) or \
                first in s.stop_token_ids:
            self._release(rid)
            reason = "length" if s.max_tokens <= 1 else "stop"
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.FINISH,
                                         finish_reason=reason, prompt_tokens=n))
            return
        rest = msgspec.structs.replace(s, max_tokens=s.max_tokens - 1,
                                   min_tokens=max(0, s.min_tokens - 1))
        body = completion_body(self.cfg, [*res.token_ids, first], rest)
        if rid not in self.pool_held:
            self._start(ident, rid, body, n, 1)
            return
        assert self.loop is not None
        job = self.loop.create_task(self._continue(ident, rid, body, n))
        self.tasks[rid] = (ident, job)

    async def _continue(self, ident: bytes, rid: str, body: dict[str, Any], n: int) -> None:
        """Decode: wait (at most ``handoff_wait_s``) for the prefill's `KvStreamed`, then ask
        vLLM for the rest reading the pool (``yuebing_recv``), or from the store if the stream
        failed or did not end in time."""
        assert self.loop is not None and self.handoff is not None
        streamed = self.streamed.pop(rid, None)
        if streamed is None:
            wait = self.stream_waits[rid] = self.loop.create_future()
            try:
                streamed = await asyncio.wait_for(wait, self.cfg.handoff_wait_s)
            except TimeoutError:
                streamed = None
            finally:
                self.stream_waits.pop(rid, None)
        breakdown = None
        if streamed is not None and streamed.ok:
            body["kv_transfer_params"] = {RECV_KEY: StreamParams(
                rid, self.handoff.segment, self.handoff.pool.num_blocks,
                tuple(self.pool_held[rid]), n).to_params()}
            breakdown = Breakdown(
                transfer_s=max(0.0, streamed.complete_at_s - streamed.last_layer_at_s),
                kv_bytes=streamed.bytes, streamed_layers=streamed.layers,
                layers_before_prefill_end=streamed.layers_before_last)
        else:
            log.warning("%s: %s; the decode loads the KV from the store", rid,
                        "no layer-wise stream in time" if streamed is None else
                        f"the layer-wise stream failed ({streamed.error})")
            self._release(rid, settled=streamed is not None)
        await self._relay(ident, rid, body, n, 1, None, breakdown)

    def sweep(self) -> None:
        """Reservations whose `KvReady` did not come in time end with an error; quarantined
        pool blocks whose reservation expired are free again."""
        if self.quarantined and self.handoff is not None:
            wall = time.time()
            for _, blocks in [q for q in self.quarantined if q[0] <= wall]:
                self.handoff.give_back(blocks)
            self.quarantined = [q for q in self.quarantined if q[0] > wall]
        now = time.monotonic()
        for rid, (ident, _, deadline) in list(self.reserved.items()):
            if deadline <= now:
                del self.reserved[rid]
                self._release(rid)
                self._event(ident, TaskEvent(request_id=rid, kind=EventKind.ERROR,
                                             error_code=ErrorCode.TRANSFER,
                                             error="no KV arrived for the reservation in time"))

    # ------------------------------------------------------------------ tasks
    def _event(self, ident: bytes, ev: TaskEvent) -> None:
        ev.time_s = time.time()
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, encode(TaskEvents(events=[ev]))], zmq.NOBLOCK)

    async def _relay(self, ident: bytes, rid: str, body: dict[str, Any], n: int, outputs: int,
                     target: DecodeTarget | None, breakdown: Breakdown | None = None) -> None:
        """Stream vLLM's answer as events (``outputs``: tokens sent before, by the prefill);
        with ``target`` (prefill), hand the KV off to that decode before FINISH; FINISH
        carries ``breakdown``, and where this relay gave the first token, ``queue_s``: vLLM's
        own queue (its per-request metrics, 0 without them) and ``prefill_s``: the rest of the
        time from the request sent to vLLM to its first token; on a decode's continuation,
        vLLM's queue there as ``decode_wait_s``."""
        reason: str | None = None
        queue_s: float | None = None
        first: tuple[int, float] | None = None
        sent_at, outputs_before = time.time(), outputs
        assert self.http is not None
        try:
            async with self.http.post(self.cfg.vllm_url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"vLLM answered {r.status}: {(await r.text())[:300]}")
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    choices = chunk.get("choices") or []
                    if not choices:  # the usage chunk: vLLM's per-request metrics ride on it
                        queue_s = vllm_queue_s(chunk) if queue_s is None else queue_s
                        continue
                    c = choices[0]
                    ids = list(c.get("token_ids") or [])
                    reason = c.get("finish_reason") or reason
                    if ids or c.get("text"):
                        self._release(rid, settled=True)  # its vLLM has read the pool blocks
                        now = time.time()
                        first = first or ((ids or [0])[0], now)
                        kind = EventKind.FIRST_TOKEN if outputs == 0 else EventKind.TOKENS
                        outputs += len(ids)
                        self._event(ident, TaskEvent(
                            request_id=rid, kind=kind, token_ids=ids, token_times=[now] * len(ids),
                            text=c.get("text", ""), prompt_tokens=n))
            if target is not None:
                if first is None:
                    raise RuntimeError("vLLM gave no first token")
                await self._hand_off(rid, body["prompt"], first, target,
                                     layerwise="kv_transfer_params" in body)
                reason = "handoff"
            if first is not None and outputs_before == 0:
                queued = min(queue_s or 0.0, first[1] - sent_at)
                breakdown = msgspec.structs.replace(breakdown or Breakdown(), queue_s=queued,
                                                    prefill_s=first[1] - sent_at - queued)
            elif queue_s and outputs_before > 0:  # a decode's continuation: vLLM's queue
                # delays its first step
                breakdown = msgspec.structs.replace(breakdown or Breakdown(),
                                                    decode_wait_s=queue_s)
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.FINISH,
                                         finish_reason=reason or "stop", prompt_tokens=n,
                                         breakdown=breakdown))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure ends the task with an error event
            log.warning("%s: vLLM request failed: %s", rid, e)
            code = ErrorCode.TRANSFER if isinstance(e, HandoffError) else ErrorCode.INTERNAL
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.ERROR,
                                         error_code=code, error=str(e)))
        finally:
            self._release(rid)
            if self.tasks.get(rid, (None, None))[1] is asyncio.current_task():
                self.tasks.pop(rid, None)

    async def _hand_off(self, rid: str, prompt: list[int], first: tuple[int, float],
                        target: DecodeTarget, layerwise: bool) -> None:
        """Prefill: `KvReady` to the decode, at once when its vLLM streamed the KV layer-wise,
        else once the store holds the prompt's blocks (`HandoffError` if it cannot be told)."""
        assert self.handoff is not None and self.loop is not None
        end = time.time()
        if not layerwise:
            held = await self.loop.run_in_executor(None, self.handoff.wait_stored, prompt)
            log.info("%s: hand-off to %s through the store, %d store blocks held", rid,
                     target.instance_id, held)
        msg = KvReady(request_id=rid, num_tokens=len(prompt), first_token=first[0],
                      first_token_time_s=first[1], prefill_end_s=end)
        err = await self.loop.run_in_executor(None, self.handoff.tell, target.segment, msg)
        if err:
            raise HandoffError(f"telling decode {target.instance_id} failed: {err}")


    # ------------------------------------------------------------------ KV events
    async def _kv_events(self, sub: zmq.asyncio.Socket) -> None:
        """Feed vLLM's KV-cache events into `kv_index` (its keys go out in the reports). After
        a gap, the lost events are asked from vLLM's replay endpoint; without them the index
        is reset (`KvEventIndex.reset`). Frames that arrive meanwhile wait in the socket."""
        while True:
            parts = await sub.recv_multipart()
            start = self.kv_index.frame(parts)
            if start is None:
                continue
            frames = await self._replay(start)
            # after the replay, this frame is a repeat of one of its frames, or the next
            if frames is None or not self.kv_index.replay(frames) or \
                    self.kv_index.frame(parts, live=False) is not None:
                self.kv_index.reset(int.from_bytes(parts[1], "big") - 1)
                self.kv_index.frame(parts)

    async def _replay(self, start: int) -> list[list[bytes]] | None:
        """vLLM's buffered event frames from ``start`` on (its ROUTER answers ``[b"", topic,
        seq, payload]`` each, then an end marker of seq -1); None without a replay endpoint,
        or when it does not answer within ``replay_timeout_s``."""
        if self.cfg.kv_replay_port <= 0:
            return None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.cfg.kv_replay_port}")
        frames: list[list[bytes]] = []
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            async with asyncio.timeout(self.cfg.replay_timeout_s):
                while True:
                    reply = await sock.recv_multipart()
                    if len(reply) != 4:
                        return None
                    if int.from_bytes(reply[2], "big", signed=True) < 0:
                        return frames
                    frames.append(reply[1:])
        except TimeoutError:
            log.warning("vLLM's KV event replay from %d did not answer in %.1f s", start,
                        self.cfg.replay_timeout_s)
            return None
        finally:
            sock.close()

    # ------------------------------------------------------------------ load reports
    async def _reports(self) -> None:
        """A report every ``report_s`` from the last load seen, whatever vLLM's ``/metrics``
        takes to answer (a busy vLLM answers late; a late report would make the Conductor
        think the instance dead)."""
        poll: asyncio.Task[None] | None = None
        while True:
            if poll is None or poll.done():
                poll = asyncio.get_running_loop().create_task(self._poll_metrics())
            self.sweep()
            self._report()
            await asyncio.sleep(self.cfg.report_s)

    async def _poll_metrics(self) -> None:
        assert self.http is not None
        try:
            async with self.http.get(self.cfg.vllm_url + "/metrics",
                                     timeout=aiohttp.ClientTimeout(total=10)) as r:
                self.load = parse_metrics(await r.text())
        except Exception as e:  # noqa: BLE001 - a missed poll keeps the last load
            log.debug("vLLM /metrics: %s", e)

    def _report(self) -> None:
        self.report_seq += 1
        load = self.load
        added, removed, full = self.kv_index.take(self.resync)
        self.resync = False
        report = LoadReport(
            instance_id=self.cfg.instance_id, incarnation=self.incarnation,
            report_seq=self.report_seq, time_s=time.time(), queued_prefill_tokens=0,
            queued_requests=load.waiting, running=load.running, waiting=load.waiting,
            context_tokens=0, free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            reserved_blocks=0, prefill_tokens_per_s=0.0, decode_step_s=0.0,
            cache_added=added, cache_removed=removed, cache_full_resync=full)
        frame = encode(report)
        for ident in list(self.subscribers):
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
