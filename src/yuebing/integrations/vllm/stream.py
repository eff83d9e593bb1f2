"""Layer-wise prefill → decode KV streaming between two vLLM instances, over the transfer engine.

The decode's adapter (`instance.VllmInstance`) owns a `RecvPool`, a shared-memory segment of
vLLM blocks of every layer; the Conductor's `Reserve` takes the prompt's blocks there and the
prefill's vLLM gets them in ``kv_transfer_params`` (``yuebing_send``). `LayerSender` (prefill
worker) WRITEs each layer out of the paged cache as soon as it is computed; `LayerReceiver`
(decode worker, asked with ``yuebing_recv``) READs each layer in before its attention: one copy
each way, no tail recomputed. A failed WRITE ends in ``KvStreamed(ok=False)`` (the decode falls
back to the store); a failed READ sends the request's blocks to vLLM's recompute.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.protocol import encode
from yuebing.protocol.instance import KvStreamed
from yuebing.transfer.engine import TransferEngine
from yuebing.transfer.types import BatchId, OpCode, TransferRequest, TransferStatus

if TYPE_CHECKING:  # torch comes with vLLM's process: importing this module (the CLI) needs none
    import torch

log = logging.getLogger(__name__)

KV_STREAMED_TOPIC = "yuebing.vllm.kv_streamed"
"""The notification topic of `KvStreamed` (prefill worker → decode adapter)."""

EXPIRY_MARGIN_S = 2.0
"""A prefill stops writing into a decode's pool blocks this long before its reservation
expires (after that the decode may give them to another request)."""


@dataclass(frozen=True)
class RecvPool:
    """The decode's receive pool: ``num_blocks`` vLLM blocks of each of ``layers`` layers,
    ``block_bytes`` each, laid out layer-major (layer ``l``, block ``b`` at
    ``(l * num_blocks + b) * block_bytes``). A `Reserve` takes a prompt's blocks from it, the
    partial last block included."""

    layers: int
    num_blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.layers * self.num_blocks * self.block_bytes

    def offset(self, layer: int, block: int) -> int:
        return (layer * self.num_blocks + block) * self.block_bytes


@dataclass(frozen=True)
class StreamJob:
    """One request's blocks of one step bound for (or coming from) a decode's pool: the
    request's vLLM blocks ``first`` .. ``first + len(block_ids) - 1`` are ``block_ids`` here
    and ``pool_blocks`` there. ``last``: this step completes the prompt (send: tell the
    decode after it)."""

    req_id: str
    handoff_id: str
    """The Conductor's request id (the decode's adapter knows the request by it)."""
    segment: str
    pool_blocks_total: int
    block_ids: tuple[int, ...]
    pool_blocks: tuple[int, ...]
    last: bool = False
    expires_at_s: float = 0.0
    """Send: stop writing ``EXPIRY_MARGIN_S`` before this time.time() (0 = never)."""


def runs(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both block ids go up by one."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def _bytes(t: torch.Tensor) -> Any:
    """A contiguous tensor's memory as a writable uint8 numpy view (no copy)."""
    import torch

    return t.view(-1).view(torch.uint8).numpy()


def pool(layout: KvLayout, num_blocks: int) -> RecvPool:
    return RecvPool(layout.layers, num_blocks, layout.block_bytes)


@dataclass
class _Sending:
    """A request's stream so far (all its steps)."""

    job: StreamJob
    done_at: dict[int, float] = field(default_factory=dict)
    """Per layer: time.time() its latest batch completed."""
    last_layer_at: float = 0.0
    outstanding: int = 0
    bytes: int = 0
    error: str = ""


class LayerSender:
    """The prefill worker's half. Each step, as soon as attention layer ``l`` has written its
    K/V, `send_layer` submits WRITEs of the step's blocks of layer ``l`` straight out of vLLM's
    paged cache into the pool (consecutive blocks are one WRITE) and returns, so layer ``l+1``
    computes while ``l`` moves; a waiter thread stamps each layer's completion. `end_step`
    (vLLM's ``wait_for_save``) waits for the WRITEs and, once the prompt is complete, tells the
    decode's adapter `KvStreamed` (with how many layers landed before the last was computed)."""

    def __init__(self, layout: KvLayout, transfer: TransferEngine,
                 timeout_s: float = 10.0) -> None:
        self.layout = layout
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.streams: dict[str, _Sending] = {}
        self._cond = threading.Condition()
        self._waits: queue.SimpleQueue[tuple[_Sending, int, BatchId] | None] = \
            queue.SimpleQueue()
        self._waiter = threading.Thread(target=self._wait_loop, name="yuebing-vllm-send",
                                        daemon=True)
        self._waiter.start()
        self.stats = {"streams": 0, "stream_failures": 0, "bytes": 0}

    def send_layer(self, layer: int, kv_layer: torch.Tensor, jobs: list[StreamJob]) -> None:
        """Submit this layer's WRITEs of each job's blocks (does not wait for them)."""
        bb = self.layout.block_bytes
        for job in jobs:
            st = self.streams.get(job.req_id)
            if st is None:
                st = self.streams[job.req_id] = _Sending(job)
            if job.expires_at_s and time.time() > job.expires_at_s - EXPIRY_MARGIN_S:
                st.error = st.error or "the decode's reservation expires"
            if st.error:
                continue
            p = RecvPool(self.layout.layers, job.pool_blocks_total, bb)
            reqs = [TransferRequest(OpCode.WRITE, _bytes(kv_layer[s:s + n]), job.segment,
                                    p.offset(layer, d), n * bb)
                    for s, d, n in runs(job.block_ids, job.pool_blocks)]
            if job.last and layer == self.layout.layers - 1:
                st.last_layer_at = time.time()
            if not reqs:
                continue
            try:
                bid = self.transfer.submit(reqs, timeout_s=self.timeout_s)
            except Exception as e:  # noqa: BLE001 - reported to the decode, which falls back
                st.error = f"layer {layer}: {e}"
                continue
            with self._cond:
                st.outstanding += 1
                st.bytes += sum(r.length or 0 for r in reqs)
            self._waits.put((st, layer, bid))

    def _wait_loop(self) -> None:
        while (item := self._waits.get()) is not None:
            st, layer, bid = item
            try:
                status = self.transfer.wait(bid)
                self.transfer.free(bid)
                ok = status.status == TransferStatus.DONE
                err = "" if ok else f"layer {layer}: {status.status.name}"
            except Exception as e:  # noqa: BLE001 - reported to the decode
                err = f"layer {layer}: {e}"
            with self._cond:
                st.done_at[layer] = time.time()
                st.error = st.error or err
                st.outstanding -= 1
                self._cond.notify_all()

    def end_step(self, jobs: list[StreamJob]) -> None:
        """The step's forward is over: wait for its WRITEs (the paged blocks may change after
        the step), then tell the decode of each request whose prompt is complete."""
        deadline = time.monotonic() + self.timeout_s
        for job in jobs:
            st = self.streams.get(job.req_id)
            if st is None:
                continue
            with self._cond:
                while st.outstanding and time.monotonic() < deadline:
                    self._cond.wait(max(0.0, deadline - time.monotonic()))
                if st.outstanding:
                    st.error = st.error or f"WRITEs not done within {self.timeout_s}s"
            if job.last:
                self._tell(self.streams.pop(job.req_id))

    def _tell(self, st: _Sending) -> None:
        layers = self.layout.layers
        before = sum(1 for li in range(layers)
                     if li in st.done_at and st.done_at[li] <= st.last_layer_at)
        complete = max(st.done_at.values(), default=0.0)
        msg = KvStreamed(request_id=st.job.handoff_id, ok=not st.error, error=st.error,
                         layers=len(st.done_at), layers_before_last=before, bytes=st.bytes,
                         last_layer_at_s=st.last_layer_at, complete_at_s=complete)
        self.stats["streams"] += 1
        self.stats["stream_failures"] += bool(st.error)
        self.stats["bytes"] += st.bytes
        log.info("yuebing layer-wise hand-off: request %s, %d layers, %d before the last was "
                 "computed, %d bytes%s", st.job.handoff_id, msg.layers, before, st.bytes,
                 f", failed: {st.error}" if st.error else "")
        try:
            self.transfer.notify(st.job.segment, KV_STREAMED_TOPIC, encode(msg),
                                 timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the decode falls back when nothing comes
            log.warning("telling the decode of request %s failed: %s", st.job.handoff_id, e)

    def drop(self, req_id: str) -> None:
        """A request that ended before its prompt was complete."""
        self.streams.pop(req_id, None)

    def close(self) -> None:
        self._waits.put(None)
        self._waiter.join(timeout=5)


class LayerReceiver:
    """The decode worker's half: `start` READs the pool blocks straight into the request's
    new vLLM blocks, one batch per layer; `wait_layer` waits for a layer's batch before its
    attention."""

    def __init__(self, layout: KvLayout, transfer: TransferEngine,
                 timeout_s: float = 10.0) -> None:
        self.layout = layout
        self.transfer = transfer
        self.timeout_s = timeout_s
        self._batches: dict[int, list[tuple[StreamJob, BatchId | None]]] = {}
        self._failed: set[str] = set()
        self._errors: set[int] = set()
        self.stats = {"receives": 0, "receive_failures": 0}

    def start(self, jobs: list[StreamJob], kv: list[torch.Tensor]) -> None:
        """Submit every layer's READs of the step's jobs (``kv``: the paged tensors in layer
        order)."""
        self._batches = {}
        self._failed = set()
        bb = self.layout.block_bytes
        for layer, kv_layer in enumerate(kv):
            batch: list[tuple[StreamJob, BatchId | None]] = []
            for job in jobs:
                p = RecvPool(self.layout.layers, job.pool_blocks_total, bb)
                reqs = [TransferRequest(OpCode.READ, _bytes(kv_layer[d:d + n]), job.segment,
                                        p.offset(layer, s), n * bb)
                        for d, s, n in runs(job.block_ids, job.pool_blocks)]
                try:
                    batch.append((job, self.transfer.submit(reqs, timeout_s=self.timeout_s)))
                except Exception as e:  # noqa: BLE001 - the blocks are recomputed
                    log.warning("reading request %s from %s failed: %s", job.req_id,
                                job.segment, e)
                    batch.append((job, None))
            self._batches[layer] = batch
        self.stats["receives"] += len(jobs)

    def wait_layer(self, layer: int) -> None:
        """Wait for this layer's READs; a failed one marks its request's blocks failed."""
        for job, bid in self._batches.pop(layer, []):
            ok = False
            if bid is not None:
                try:
                    ok = self.transfer.wait(bid).status == TransferStatus.DONE
                    self.transfer.free(bid)
                except Exception as e:  # noqa: BLE001 - the blocks are recomputed
                    log.warning("reading request %s failed: %s", job.req_id, e)
            if not ok and job.req_id not in self._failed:
                self._failed.add(job.req_id)
                self._errors.update(job.block_ids)
                self.stats["receive_failures"] += 1

    def end(self) -> None:
        for layer in list(self._batches):
            self.wait_layer(layer)

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors
