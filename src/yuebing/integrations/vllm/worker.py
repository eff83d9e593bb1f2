"""`WorkerSide`: the half of `YuebingConnector` that runs in vLLM's worker, next to the paged KV.

Per step: `start_load` reads the step's `LoadJob` objects from the store (one ``batch_get_into``
into a staging buffer on the load thread, bounded by ``load_timeout_s``); each attention layer's
`wait_layer` copies its slice of every object into its vLLM blocks; `save_layer` copies each
`SaveJob`'s blocks of the layer out (vLLM may reuse them once the step ends); `end_step` hands
complete objects to the save thread (one ``batch_put``, off the step's path). A failed load
fails that object and every later one of the request: their blocks go to `load_errors`, which
vLLM recomputes, never wrong KV. A failed save is logged and dropped; hand-offs: `stream`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from yuebing.integrations.vllm.layout import KvLayout
from yuebing.integrations.vllm.plan import LoadJob, SaveJob
from yuebing.integrations.vllm.stream import LayerReceiver, LayerSender, StreamJob

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names: list[str]) -> list[str]:
    """Layer names in model order: by the first ``.<n>.`` index in the name, else as given."""
    def key(item: tuple[int, str]) -> tuple[int, int]:
        m = _LAYER_INDEX.search(item[1])
        return (int(m.group(1)) if m else -1, item[0])
    return [n for _, n in sorted(enumerate(names), key=key)]


@dataclass
class _Fetched:
    """A load's objects in staging: ``data`` as ``[objects, layers, blocks per object, *block]``
    and how many leading objects were read whole (``ok``)."""

    job: LoadJob
    data: torch.Tensor
    ok: int


class WorkerSide:
    """Store reads into and writes out of one worker's paged KV tensors. Layer-wise hand-offs
    (`stream.LayerSender`, `stream.LayerReceiver`) run beside them, on a transfer engine made
    at the first one."""

    def __init__(self, layout: KvLayout, reader: Any | None, writer: Any | None,
                 load_timeout_s: float = 2.0, save_timeout_s: float = 15.0,
                 max_pending_save_bytes: int = 256 << 20,
                 transfer: Callable[[], Any] | None = None) -> None:
        self.layout = layout
        self._transfer_factory = transfer
        self._transfer: Any = None
        self._sender: LayerSender | None = None
        self._receiver: LayerReceiver | None = None
        self.reader = reader
        self.writer = writer
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.max_pending_save_bytes = max_pending_save_bytes
        self.dtype = TORCH_DTYPES[layout.dtype]
        self.layers: dict[str, int] = {}
        self.kv: dict[str, torch.Tensor] = {}
        self._loads = concurrent.futures.ThreadPoolExecutor(1, "yuebing-vllm-load")
        self._saves = concurrent.futures.ThreadPoolExecutor(1, "yuebing-vllm-save")
        self._fetch: concurrent.futures.Future[list[_Fetched]] | None = None
        self._fetched: list[_Fetched] = []
        self._errors: set[int] = set()
        self._save_bufs: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._lock = threading.Lock()
        self.stats = {"loads": 0, "loaded_objects": 0, "load_failures": 0, "saves": 0,
                      "saved_objects": 0, "save_failures": 0, "saves_dropped": 0}

    # ------------------------------------------------------------------ set-up
    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's paged KV tensors, one per attention layer, checked against the layout."""
        names = layer_order(list(kv_caches))
        if len(names) != self.layout.layers:
            raise ValueError(f"vLLM has {len(names)} KV layers, the yuebing connector's layout "
                             f"has {self.layout.layers} ({self.layout.fingerprint()})")
        for name in names:
            t = kv_caches[name]
            self.layout.check_tensor_shape(name, t.shape)
            if t.dtype != self.dtype:
                raise ValueError(f"vLLM's KV tensor {name} is {t.dtype}, the yuebing connector "
                                 f"expects {self.dtype} ({self.layout.fingerprint()})")
        self.layers = {n: i for i, n in enumerate(names)}
        self.kv = {n: kv_caches[n] for n in names}

    def _objects(self, nbytes: int, n: int) -> torch.Tensor:
        lay = self.layout
        return torch.empty(n * nbytes, dtype=torch.uint8).view(self.dtype).view(
            n, lay.layers, lay.blocks_per_object, *lay.block_shape)

    # ------------------------------------------------------------------ layer-wise hand-off
    def _engine(self) -> Any:
        if self._transfer is None:
            if self._transfer_factory is None:
                raise RuntimeError("no transfer engine for a layer-wise hand-off")
            self._transfer = self._transfer_factory()
        return self._transfer

    def sender(self) -> LayerSender:
        if self._sender is None:
            self._sender = LayerSender(self.layout, self._engine(), self.load_timeout_s * 5)
        return self._sender

    def receiver(self) -> LayerReceiver:
        if self._receiver is None:
            self._receiver = LayerReceiver(self.layout, self._engine(), self.load_timeout_s * 5)
        return self._receiver

    def start_receive(self, jobs: list[StreamJob]) -> None:
        """Start reading the step's layer-wise hand-offs into their vLLM blocks."""
        if jobs:
            self.receiver().start(jobs, list(self.kv.values()))

    def send_layer(self, name: str, kv_layer: torch.Tensor, jobs: list[StreamJob]) -> None:
        li = self.layers.get(name)
        if li is not None and jobs:
            self.sender().send_layer(li, kv_layer, jobs)

    def forget_sends(self, req_ids: list[str]) -> None:
        """Requests that ended before their stream did (aborted)."""
        if self._sender is not None:
            for rid in req_ids:
                self._sender.drop(rid)

    def end_send(self, jobs: list[StreamJob]) -> None:
        if jobs:
            self.sender().end_step(jobs)

    # ------------------------------------------------------------------ loads
    def start_load(self, jobs: list[LoadJob]) -> None:
        """Start reading the step's loads (the layers wait for them in `wait_layer`)."""
        self._fetched = []
        self._fetch = self._loads.submit(self._read, jobs) if jobs else None

    def _read(self, jobs: list[LoadJob]) -> list[_Fetched]:
        nbytes = self.layout.object_bytes
        out = [_Fetched(j, self._objects(nbytes, len(j.keys)), 0) for j in jobs]
        keys = [k for j in jobs for k in j.keys]
        bufs = [f.data[i].view(-1).view(torch.uint8).numpy()
                for f in out for i in range(len(f.job.keys))]
        try:
            if self.reader is None:
                raise RuntimeError("no store client")
            with self.reader.limited(self.load_timeout_s):
                sizes = list(self.reader.batch_get_into(keys, bufs))
        except Exception as e:  # noqa: BLE001 - every failure is a recompute, never an error
            log.warning("yuebing store read of %d objects failed (%s); recomputing", len(keys), e)
            sizes = [-1] * len(keys)
        at = 0
        for f in out:
            n = len(f.job.keys)
            mine = sizes[at:at + n]
            at += n
            f.ok = next((i for i, s in enumerate(mine) if s != nbytes), n)
            if f.ok < n:
                bad = mine[f.ok]
                log.warning("yuebing store object %s %s; recomputing from there",
                            f.job.keys[f.ok], "missing or unreadable" if bad < 0 else
                            f"has {bad} bytes, expected {nbytes} (refused)")
        return out

    def _wait_fetch(self) -> None:
        if self._fetch is None:
            return
        fetch, self._fetch = self._fetch, None
        self._fetched = fetch.result()
        for f in self._fetched:
            failed = [bid for obj, _, bid in f.job.blocks if obj >= f.ok]
            self._errors.update(failed)
            self.stats["loads"] += 1
            self.stats["loaded_objects"] += f.ok
            self.stats["load_failures"] += bool(failed)
            log.info("yuebing store load: request %s, %d/%d objects, %d vLLM blocks",
                     f.job.req_id, f.ok, len(f.job.keys), len(f.job.blocks) - len(failed))

    def wait_layer(self, name: str) -> None:
        """Wait for this layer of the step's hand-offs; copy this layer of the step's loaded
        objects into its vLLM blocks."""
        li = self.layers.get(name)
        if li is not None and self._receiver is not None:
            self._receiver.wait_layer(li)
        self._wait_fetch()
        if li is None or not self._fetched:
            return
        kv = self.kv[name]
        for f in self._fetched:
            rows = [(o, s, b) for o, s, b in f.job.blocks if o < f.ok]
            if not rows:
                continue
            obj = torch.tensor([r[0] for r in rows])
            sub = torch.tensor([r[1] for r in rows])
            dst = torch.tensor([r[2] for r in rows])
            kv.index_copy_(0, dst, f.data[obj, li, sub])

    def end_load(self) -> None:
        """The step's forward is over: the loaded objects are no longer needed."""
        if self._receiver is not None:
            self._receiver.end()
        self._wait_fetch()
        self._fetched = []

    def load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call."""
        errors, self._errors = self._errors, set()
        if self._receiver is not None:
            errors |= self._receiver.load_errors()
        return errors

    # ------------------------------------------------------------------ saves
    def save_layer(self, name: str, kv_layer: torch.Tensor, jobs: list[SaveJob]) -> None:
        """Copy this layer of each save job's vLLM blocks into the job's object."""
        li = self.layers.get(name)
        if li is None:
            return
        for job in jobs:
            buf = self._save_bufs.get(job.key)
            if buf is None:
                with self._lock:
                    if self._pending_bytes + self.layout.object_bytes > self.max_pending_save_bytes:
                        self.stats["saves_dropped"] += 1
                        continue
                    self._pending_bytes += self.layout.object_bytes
                buf = self._save_bufs[job.key] = self._objects(self.layout.object_bytes, 1)[0]
            torch.index_select(kv_layer, 0, torch.tensor(job.block_ids), out=buf[li])

    def end_step(self) -> None:
        """Hand the step's complete objects to the save thread."""
        bufs, self._save_bufs = self._save_bufs, {}
        if bufs:
            self._saves.submit(self._put, list(bufs), list(bufs.values()))

    def _put(self, keys: list[str], bufs: list[torch.Tensor]) -> None:
        try:
            if self.writer is None:
                raise RuntimeError("no store client")
            with self.writer.limited(self.save_timeout_s):
                codes = self.writer.batch_put(keys, [b.view(-1).view(torch.uint8).numpy()
                                                     for b in bufs])
            self.stats["saves"] += 1
            self.stats["saved_objects"] += sum(1 for c in codes if c == 0)
            log.info("yuebing store save: %d objects (%d new)", len(keys),
                     sum(1 for c in codes if c == 0))
        except Exception as e:  # noqa: BLE001 - a failed save is a later miss, never an error
            self.stats["save_failures"] += 1
            log.warning("yuebing store save of %d objects failed: %s", len(keys), e)
        finally:
            with self._lock:
                self._pending_bytes -= len(bufs) * self.layout.object_bytes

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait for the saves handed over so far (tests, shutdown)."""
        self._saves.submit(lambda: None).result(timeout=timeout_s)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        if self._transfer is not None:
            self._transfer.close()
        self._loads.shutdown(wait=True, cancel_futures=True)
        self._saves.shutdown(wait=True)
        for client in (self.reader, self.writer):
            if client is not None:
                client.close()
