"""`KvStreamer`: layer-wise KV streaming from a prefill engine into a decode's reserved blocks.

A layer hook on the prefill engine (driver thread): right after layer ``l`` wrote its K/V it
submits transfer WRITEs of that layer's K and V for every watched request of the step straight
into the decode's KV pool segment, then returns, so layer ``l+1`` computes while the bytes move.
A waiter thread stamps each batch's completion, so `finish` can tell how many layers landed
before the prefill's last one was computed. Called by the prefill role: `watch` before adding
the request, `finish` (blocking) after its first token, `drop` on cancel.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from yuebing.engine.attention import AttnMetadata
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sequence import Sequence
from yuebing.protocol.instance import DecodeTarget
from yuebing.transfer.engine import TransferEngine
from yuebing.transfer.types import BatchId, OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)

EXPIRY_MARGIN_S = 2.0
"""A prefill stops writing into a decode's reservation this long before it expires (the
decode reuses expired blocks only after its fence)."""


@dataclass
class StreamState:
    target: DecodeTarget
    sent_blocks: int = 0
    """Leading blocks fully sent for every layer (a partial last block is sent again)."""
    batches: list[tuple[int, BatchId]] = field(default_factory=list)
    """(layer, batch id) in submission order."""
    done_at: dict[BatchId, float] = field(default_factory=dict)
    """Per batch id: perf_counter() when it completed."""
    failed: list[str] = field(default_factory=list)
    last_layer_at: float = 0.0
    """perf_counter() when the prefill's last layer of its last chunk was computed."""
    bytes: int = 0
    outstanding: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)


_Part = tuple[StreamState, list[int], list[TransferRequest]]
"""One request's share of a layer's batch: its state, the layers it covers, its WRITEs."""


@dataclass
class StreamResult:
    ok: bool
    error: str
    bytes: int
    layers: int
    layers_before_last: int
    """Layers whose every batch had completed before the last layer was computed."""
    last_layer_at: float
    complete_at: float


class KvStreamer:
    """See the module docstring.

    The blocks the step touched (plus, on a request's first step, its prefix-cache hits) are
    written at the `KvLayout` offsets; consecutive (prefill block, decode block) runs become one
    transfer request, and a step's requests bound for one decode segment go as one batch per layer
    (each request's part judged on its own). A chunk whose KV per layer is under ``whole_below``
    bytes (``--layerwise-min-bytes``) goes in one batch of all its layers after its last layer."""

    def __init__(self, engine: LLMEngine, transfer: TransferEngine,
                 timeout_s: float = 30.0, whole_below: int = 0) -> None:
        self.engine = engine
        self.transfer = transfer
        self.timeout_s = timeout_s
        self.whole_below = whole_below
        pool = engine.pool
        self.num_layers = pool.num_layers
        self.first_layer = engine.layers[0]
        """A pipeline stage streams only its layers, at their place in the decode's pool."""
        self.model_layers = engine.model_config.num_layers
        self.chunk = pool.chunk_nbytes
        self._bytes = pool.data.view(torch.uint8).reshape(-1).numpy()
        self._states: dict[str, StreamState] = {}
        self._lock = threading.Lock()
        self._waits: queue.Queue[tuple[list[tuple[StreamState, int, int]], BatchId] | None] = \
            queue.Queue()
        self._waiter = threading.Thread(target=self._wait_loop, name="kv-stream-wait",
                                        daemon=True)
        self._waiter.start()
        engine.add_layer_hook(self)

    # ------------------------------------------------------------------ control

    def watch(self, request_id: str, target: DecodeTarget) -> None:
        lay = target.layout
        fp = self.engine.model_fingerprint
        if lay.num_layers != self.model_layers or lay.block_size != self.engine.block_size or \
                lay.chunk_bytes != self.chunk or lay.fingerprint != fp:
            raise ValueError(
                f"decode {target.instance_id} computes other KV (fingerprint "
                f"{lay.fingerprint}, {lay.num_layers} layers, block {lay.block_size}, chunk "
                f"{lay.chunk_bytes} B); this prefill has {fp}, "
                f"{self.model_layers} layers, block {self.engine.block_size}, chunk {self.chunk} B")
        with self._lock:
            self._states[request_id] = StreamState(target)

    def drop(self, request_id: str, wait_s: float = 0.0) -> bool:
        """Stop streaming a request; with ``wait_s``, also wait (blocking) until none of its
        writes is in flight. Returns whether none is."""
        with self._lock:
            st = self._states.pop(request_id, None)
        if st is None:
            return True
        end = time.monotonic() + wait_s
        with st.cond:
            st.failed.append("cancelled")
            while st.outstanding and time.monotonic() < end:
                st.cond.wait(0.05)
            return st.outstanding == 0

    def finish(self, request_id: str) -> StreamResult:
        """Wait for every batch of the request (blocking) and forget it."""
        with self._lock:
            st = self._states.pop(request_id, None)
        if st is None:
            return StreamResult(False, "request was not streamed", 0, 0, 0, 0.0, 0.0)
        deadline = time.monotonic() + self.timeout_s
        with st.cond:
            while st.outstanding and time.monotonic() < deadline:
                st.cond.wait(0.05)
        if st.outstanding:
            st.failed.append(f"{st.outstanding} layer batches not done in {self.timeout_s} s")
        last_done: dict[int, float] = {}
        for layer, bid in st.batches:
            t = st.done_at.get(bid, float("inf"))
            last_done[layer] = max(last_done.get(layer, 0.0), t)
        before = sum(1 for t in last_done.values() if t <= st.last_layer_at)
        complete = max(last_done.values(), default=st.last_layer_at)
        return StreamResult(not st.failed, "; ".join(st.failed), st.bytes, len(last_done),
                            before, st.last_layer_at, complete)

    def close(self) -> None:
        self.engine.remove_layer_hook(self)
        self._waits.put(None)

    # ------------------------------------------------------------------ hook (driver thread)

    def __call__(self, layer: int, meta: AttnMetadata) -> None:
        plan = self.engine.current_plan
        if plan is None or not self._states:
            return
        groups: dict[str, list[_Part]] = {}
        for seq, n in [(s, 1) for s in plan.decodes] + list(plan.prefills):
            st = self._states.get(seq.request_id)
            if st is not None:
                part = self._layer_part(st, seq, n, layer)
                if part is not None:
                    groups.setdefault(st.target.segment, []).append(part)
        for parts in groups.values():
            self._submit(layer, parts)

    def _layer_part(self, st: StreamState, seq: Sequence, n: int, layer: int) -> _Part | None:
        """The WRITEs of the blocks this chunk completed: full blocks only, and the partial
        last block with the final chunk. Each block is written exactly once, so two batches
        never race for the same bytes (TCP lanes do not order them). A chunk whose KV per
        layer is under ``whole_below`` bytes goes in one batch after its last layer: for short
        prompts a batch per layer costs more than its bytes."""
        expiry = st.target.expires_at_s
        if st.failed or (expiry and time.time() > expiry - EXPIRY_MARGIN_S):
            if not st.failed:
                st.failed.append("the decode's reservation expired before the KV was sent")
            return None
        bs = self.engine.block_size
        done = seq.num_computed + n
        final = done >= len(seq.prompt_ids)
        end = min(-(-done // bs) if final else done // bs, len(st.target.blocks))
        pairs = list(zip(seq.blocks[st.sent_blocks:end], st.target.blocks[st.sent_blocks:end],
                         strict=True))
        last = layer == self.first_layer + self.num_layers - 1
        if last:
            st.sent_blocks = end
            if final:
                st.last_layer_at = time.perf_counter()
        if not pairs:
            return None
        if 2 * len(pairs) * self.chunk >= self.whole_below:
            return st, [layer], self._requests(st.target, layer, pairs)
        if not last:
            return None
        layers = list(range(self.first_layer, self.first_layer + self.num_layers))
        return st, layers, [r for i in layers for r in self._requests(st.target, i, pairs)]

    def _submit(self, layer: int, parts: list[_Part]) -> None:
        """One transfer batch for the layer's writes of every request of the step that goes to
        one decode segment (a batch per request and layer costs the engine thread more than
        its bytes when prompts are short); each request's part is judged on its own."""
        with contextlib.ExitStack() as held:
            for st, _, _ in parts:  # a concurrent drop() sees this batch outstanding, or not
                held.enter_context(st.cond)
            live = [part for part in parts if not part[0].failed]
            if not live:
                return
            reqs = [r for _, _, rs in live for r in rs]
            try:
                bid = self.transfer.submit(reqs, timeout_s=self.timeout_s)
            except Exception as e:  # an unreachable decode fails the requests, not the step
                for st, _, _ in live:
                    st.failed.append(f"layer {layer}: {e}")
                return
            spans, lo = [], 0
            for st, layers, rs in live:
                st.outstanding += 1
                st.batches += [(i, bid) for i in layers]
                st.bytes += sum(r.length or 0 for r in rs)
                spans.append((st, lo, lo + len(rs)))
                lo += len(rs)
        self._waits.put((spans, bid))

    def _requests(self, target: DecodeTarget, layer: int,
                  pairs: list[tuple[int, int]]) -> list[TransferRequest]:
        lay, c, src_nb = target.layout, self.chunk, self.engine.pool.num_blocks
        runs: list[list[int]] = []  # [src, dst, count]
        for s, d in pairs:
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
                runs[-1][2] += 1
            else:
                runs.append([s, d, 1])
        reqs = []
        for kv in (0, 1):
            for s, d, k in runs:
                src = (((layer - self.first_layer) * 2 + kv) * src_nb + s) * c
                dst = ((layer * 2 + kv) * lay.num_blocks + d) * c
                reqs.append(TransferRequest(OpCode.WRITE, self._bytes[src:src + k * c],
                                            target.segment, dst, k * c))
        return reqs

    # ------------------------------------------------------------------ waiter thread

    def _wait_loop(self) -> None:
        while (item := self._waits.get()) is not None:
            spans, bid = item
            n = max(hi for _, _, hi in spans)
            errors: list[str | None]
            try:
                status = self.transfer.wait(bid, self.timeout_s)
                errors = [None if r.status == TransferStatus.DONE else
                          f"transfer batch {bid}: {r.status.name} {r.error}".rstrip()
                          for r in status.requests]
            except Exception as e:
                errors = [f"transfer batch {bid}: {e}"] * n
            finally:
                with contextlib.suppress(Exception):  # still in flight: the reaper ends it
                    self.transfer.free(bid)
            now = time.perf_counter()
            for st, lo, hi in spans:
                with st.cond:
                    bad = [e for e in errors[lo:hi] if e]
                    if bad:
                        st.failed.append(bad[0])
                    st.done_at[bid] = now
                    st.outstanding -= 1
                    st.cond.notify_all()
