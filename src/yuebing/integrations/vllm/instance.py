"""`VllmInstance`: a vLLM OpenAI server as a yuebing serving instance (coupled role), so the
Conductor routes to it, admits against it and relays its tokens as it does for yuebing's own
instances.

A request's life: the Conductor's `SubmitTask(mode=COUPLED)` is acknowledged and relayed to vLLM
as a streamed greedy-or-sampled ``/v1/completions`` with the prompt's token ids
(``return_token_ids``); each chunk becomes a `TaskEvent` (FIRST_TOKEN, TOKENS, then FINISH with
the finish reason) to the connection that submitted it; `Cancel` closes the stream (vLLM aborts
the request). The prefix plan is not followed here: vLLM's own `YuebingConnector` looks the
prompt up in the store with the same keys. Load reports come from vLLM's ``/metrics``
(`load.parse_metrics`) every ``report_s``. `Hello` carries the fingerprint of the vLLM
instance's `KvLayout` (from the model's ``config.json``), so the Conductor refuses an instance
whose model, dtype or block size differs from the cluster's, naming both. Prefill/decode roles
(`Reserve`, `FetchPrefix`) are refused: not built yet (docs/serving.md, "vLLM instances").
Started by ``yuebing vllm instance`` (`cli/cmd_vllm.py`), which may also start the vLLM server.
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
import zmq
import zmq.asyncio

from yuebing.core.config import require
from yuebing.integrations.vllm.layout import KvLayout, layout_from_hf
from yuebing.integrations.vllm.load import VllmLoad, parse_metrics
from yuebing.protocol import Message, ProtocolError, decode, encode
from yuebing.protocol.instance import (
    Ack,
    Cancel,
    ErrorCode,
    ErrorReply,
    EventKind,
    Hello,
    LoadReport,
    Ping,
    Role,
    Sampling,
    SubmitTask,
    Subscribe,
    TaskEvent,
    TaskEvents,
    TaskMode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmInstanceConfig:
    vllm_url: str = field(default="", metadata={
        "help": "a running vLLM OpenAI server to relay to, e.g. http://127.0.0.1:8001 ('' = "
                "start one from the peers venv on --vllm-port, with the connector on --master)"})
    vllm_port: int = field(default=8001, metadata={"help": "port of the vLLM server started"})
    master: str = field(default="", metadata={
        "help": "store master of the started vLLM's YuebingConnector ('' = no connector)"})
    model_dir: str = field(default="", metadata={
        "help": "the HF model folder vLLM serves ('' = the peers venv's SmolLM2 export)"})
    instance_id: str = field(default="vllm-0", metadata={"help": "this instance's id"})
    host: str = field(default="127.0.0.1", metadata={"help": "control socket host"})
    control_port: int = field(default=0, metadata={"help": "control socket port (0 = any)"})
    served_name: str = field(default="smollm2-135m-instruct", metadata={
        "help": "vLLM's --served-model-name (also the model's name in the KV fingerprint)"})
    dtype: str = field(default="float32", metadata={"help": "vLLM's --dtype"})
    block_size: int = field(default=128, metadata={"help": "vLLM's --block-size"})
    store_block_tokens: int = field(default=256, metadata={"help": "tokens per store block"})
    max_model_len: int = field(default=4352, metadata={"help": "vLLM's --max-model-len"})
    report_s: float = field(default=0.5, metadata={"help": "load report period"})

    def __post_init__(self) -> None:
        require(not self.vllm_url or self.vllm_url.startswith("http"),
                f"vllm_url must be http(s)://host:port, got {self.vllm_url!r}")
        require(self.report_s > 0, "report_s must be > 0")

    def layout(self) -> KvLayout:
        config = json.loads((Path(self.model_dir) / "config.json").read_text())
        return layout_from_hf(config, self.served_name, self.dtype, self.block_size,
                              self.store_block_tokens)


def completion_body(cfg: VllmInstanceConfig, msg: SubmitTask) -> dict[str, Any]:
    """vLLM's ``/v1/completions`` body for a task (refused with ValueError where vLLM's answer
    could not be relayed: several choices, logprobs)."""
    s: Sampling = msg.sampling
    if s.n != 1 or s.logprobs is not None:
        raise ValueError("a vLLM instance relays one choice without logprobs (n=1)")
    body: dict[str, Any] = {
        "model": cfg.served_name, "prompt": list(msg.token_ids), "max_tokens": s.max_tokens,
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


class VllmInstance:
    """The control socket, the relayed tasks and the load reports of one vLLM server."""

    def __init__(self, cfg: VllmInstanceConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout()
        self.incarnation = uuid.uuid4().hex
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{cfg.host}") if cfg.control_port == 0 \
            else self._bind(cfg.control_port)
        self.address = f"tcp://{cfg.host}:{port}"
        self.subscribers: set[bytes] = set()
        self.tasks: dict[str, tuple[bytes, asyncio.Task[None]]] = {}
        self.load = VllmLoad()
        self.report_seq = 0
        self.http: aiohttp.ClientSession | None = None

    def _bind(self, port: int) -> int:
        self.sock.bind(f"tcp://{self.cfg.host}:{port}")
        return port

    def hello(self, seq: int) -> Hello:
        return Hello(seq=seq, instance_id=self.cfg.instance_id, role=Role.COUPLED,
                     model=self.cfg.served_name, fingerprint=self.layout.fingerprint(),
                     host=self.cfg.host, control_address=self.address, kv_segment="",
                     block_size=self.cfg.block_size,
                     store_block_tokens=self.cfg.store_block_tokens,
                     num_blocks=self.load.total_blocks, max_model_len=self.cfg.max_model_len,
                     incarnation=self.incarnation,
                     engine={"engine": "vllm", "model": self.cfg.served_name,
                             "dtype": self.cfg.dtype, "block_size": str(self.cfg.block_size)})

    # ------------------------------------------------------------------ control
    async def serve(self) -> None:
        """Answer control messages and send load reports until cancelled."""
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        reports = asyncio.get_running_loop().create_task(self._reports())
        try:
            while True:
                ident, frame = await self.sock.recv_multipart()
                try:
                    msg = decode(frame)
                except ProtocolError as e:
                    log.warning("bad control frame: %s", e)
                    continue
                reply = self.dispatch(ident, msg)
                if reply is not None:
                    await self.sock.send_multipart([ident, encode(reply)])
        finally:
            reports.cancel()
            for _, job in list(self.tasks.values()):
                job.cancel()
            await self.http.close()
            self.sock.close()
            self.ctx.term()

    def dispatch(self, ident: bytes, msg: Message) -> Message | None:
        seq = getattr(msg, "seq", 0)
        if isinstance(msg, Subscribe):
            self.subscribers.add(ident)
            return self.hello(seq)
        if isinstance(msg, Ping):
            return Ack(seq=seq)
        if isinstance(msg, Cancel):
            found = self.tasks.pop(msg.request_id, None)
            if found is None:
                return ErrorReply(seq=seq, code=ErrorCode.UNKNOWN_TASK,
                                  message=f"no task {msg.request_id}")
            found[1].cancel()
            return Ack(seq=seq)
        if isinstance(msg, SubmitTask):
            return self._submit(ident, msg)
        return ErrorReply(seq=seq, code=ErrorCode.BAD_REQUEST, message=(
            f"a vLLM instance runs COUPLED tasks only; {type(msg).__name__} is not built yet"))

    def _submit(self, ident: bytes, msg: SubmitTask) -> Message:
        if msg.mode != TaskMode.COUPLED:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST,
                              message=f"a vLLM instance runs COUPLED tasks, got {msg.mode.name}")
        if msg.request_id in self.tasks:
            return ErrorReply(seq=msg.seq, code=ErrorCode.DUPLICATE,
                              message=f"task {msg.request_id} exists")
        try:
            body = completion_body(self.cfg, msg)
        except ValueError as e:
            return ErrorReply(seq=msg.seq, code=ErrorCode.BAD_REQUEST, message=str(e))
        job = asyncio.get_running_loop().create_task(self._relay(ident, msg, body))
        self.tasks[msg.request_id] = (ident, job)
        return Ack(seq=msg.seq)

    # ------------------------------------------------------------------ tasks
    def _event(self, ident: bytes, ev: TaskEvent) -> None:
        ev.time_s = time.time()
        with contextlib.suppress(zmq.ZMQError):
            self.sock.send_multipart([ident, encode(TaskEvents(events=[ev]))], zmq.NOBLOCK)

    async def _relay(self, ident: bytes, msg: SubmitTask, body: dict[str, Any]) -> None:
        rid, n = msg.request_id, len(msg.token_ids)
        outputs = 0
        reason: str | None = None
        assert self.http is not None
        try:
            async with self.http.post(self.cfg.vllm_url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"vLLM answered {r.status}: {(await r.text())[:300]}")
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    choices = json.loads(line[5:]).get("choices") or []
                    if not choices:
                        continue
                    c = choices[0]
                    ids = list(c.get("token_ids") or [])
                    reason = c.get("finish_reason") or reason
                    if ids or c.get("text"):
                        kind = EventKind.FIRST_TOKEN if outputs == 0 else EventKind.TOKENS
                        outputs += len(ids)
                        self._event(ident, TaskEvent(
                            request_id=rid, kind=kind, token_ids=ids,
                            token_times=[time.time()] * len(ids), text=c.get("text", ""),
                            prompt_tokens=n))
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.FINISH,
                                         finish_reason=reason or "stop", prompt_tokens=n))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - any failure ends the task with an error event
            log.warning("%s: vLLM request failed: %s", rid, e)
            self._event(ident, TaskEvent(request_id=rid, kind=EventKind.ERROR,
                                         error_code=ErrorCode.INTERNAL, error=str(e)))
        finally:
            if self.tasks.get(rid, (None, None))[1] is asyncio.current_task():
                self.tasks.pop(rid, None)

    # ------------------------------------------------------------------ load reports
    async def _reports(self) -> None:
        """A report every ``report_s`` from the last load seen, whatever vLLM's ``/metrics``
        takes to answer (a busy vLLM answers late; a late report would make the Conductor
        think the instance dead)."""
        poll: asyncio.Task[None] | None = None
        while True:
            if poll is None or poll.done():
                poll = asyncio.get_running_loop().create_task(self._poll_metrics())
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
        report = LoadReport(
            instance_id=self.cfg.instance_id, incarnation=self.incarnation,
            report_seq=self.report_seq, time_s=time.time(), queued_prefill_tokens=0,
            queued_requests=load.waiting, running=load.running, waiting=load.waiting,
            context_tokens=0, free_blocks=load.free_blocks, total_blocks=load.total_blocks,
            reserved_blocks=0, prefill_tokens_per_s=0.0, decode_step_s=0.0,
            cache_full_resync=self.report_seq == 1)
        frame = encode(report)
        for ident in list(self.subscribers):
            with contextlib.suppress(zmq.ZMQError):
                self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
