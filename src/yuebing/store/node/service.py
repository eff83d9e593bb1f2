"""A storage node: contributes a DRAM segment (shared memory, registered in the transfer engine)
and optionally an SSD tier (one preallocated file) to the store.

Life cycle: register the DRAM segment with the transfer engine (clients then READ/WRITE it
directly; the node's CPU never touches put/get bytes), mount it (and the SSD tier) at the master,
then heartbeat every ``heartbeat_s``; a heartbeat reply that lacks one of our segments (the
master forgot us) triggers a re-mount. Between heartbeats the node runs the master's tier
tasks: offload (DRAM range → SSD file) and promotion (SSD file → DRAM range), answering each
with `TaskDone`. Shutdown drains (no new placements), unmounts and releases the segment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque

from yuebing.core.errors import StoreError
from yuebing.protocol import Message
from yuebing.store import messages as m
from yuebing.store.client.direct import hold_liveness_lock
from yuebing.store.client.rpc import MasterConnection
from yuebing.store.config import ClientConfig, NodeConfig
from yuebing.transfer import TransferConfig, TransferEngine

log = logging.getLogger(__name__)


class StorageNode:
    """One node process's store role. `serve` blocks until `stop`."""

    def __init__(self, cfg: NodeConfig, client: ClientConfig | None = None,
                 transfer: TransferConfig | None = None) -> None:
        self.cfg = cfg
        self.ccfg = client or ClientConfig()
        self.name = cfg.name or f"node-{uuid.uuid4().hex[:8]}"
        self.client_id = self.name
        self.engine = TransferEngine(transfer or TransferConfig(metadata="p2p"))
        self._local = f"{self.name}.dram"
        self.segment = self.engine.register_segment(self._local, size=cfg.dram,
                                                    prefault=cfg.prefault)
        self.dram_name = self.engine.segment_name(self._local)
        # held while this process lives: same-host clients copy directly only while it is
        self._live_fd = hold_liveness_lock(self.segment.shm_path) if self.segment.shm_path else -1
        self.ssd_name = ""
        self._ssd_fd = -1
        self._ssd_path = ""
        ssd = cfg.ssd_dir_size
        if ssd is not None:
            self._open_ssd(*ssd)
        self.tasks: deque[m.NodeTask] = deque()
        self.conn = MasterConnection(self.ccfg.masters, self.ccfg.rpc_timeout_s,
                                     self.ccfg.failover_s, on_push=self._on_push)
        self._stop = threading.Event()
        self.tasks_done = 0

    def _open_ssd(self, directory: str, size: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self._ssd_path = os.path.join(directory, f"{self.name}.ssd")
        self._ssd_fd = os.open(self._ssd_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._ssd_fd, size)
        self._ssd_size = size
        self.ssd_name = self.engine.segment_name(f"{self.name}.ssd")

    def mounts(self) -> list[m.Mount]:
        out = [m.Mount(client=self.client_id, segment=self.dram_name, size=self.cfg.dram,
                       tier=m.Tier.DRAM, node=self.name)]
        if self.ssd_name:
            out.append(m.Mount(client=self.client_id, segment=self.ssd_name,
                               size=self._ssd_size, tier=m.Tier.SSD, node=self.name))
        return out

    def mount(self) -> None:
        for msg in self.mounts():
            self.conn.call(msg)
        log.warning("node %s mounted %s", self.name, [x.segment for x in self.mounts()])

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.mount()
        next_hb = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_hb:
                self._heartbeat()
                next_hb = now + self.ccfg.heartbeat_s
            self.conn.poll_pushes(max(0.0, min(0.05, next_hb - time.monotonic())))
            while self.tasks:
                self._run_task(self.tasks.popleft())

    def _heartbeat(self) -> None:
        try:
            r = self.conn.call(m.Heartbeat(client=self.client_id))
        except StoreError as e:
            log.warning("heartbeat failed: %s", e)
            return
        have = set(r.segments)  # type: ignore[attr-defined]
        for msg in self.mounts():
            if msg.segment not in have:
                log.warning("master does not know %s; mounting again", msg.segment)
                with contextlib.suppress(StoreError):
                    self.conn.call(msg)

    def _on_push(self, msg: Message) -> None:
        if isinstance(msg, m.NodeTask):
            self.tasks.append(msg)

    def _run_task(self, t: m.NodeTask) -> None:
        ok, why = True, ""
        try:
            self.copy(t)
        except (OSError, ValueError, StoreError) as e:
            ok, why = False, str(e)
            log.error("tier task %d failed: %s", t.task, e)
        self.tasks_done += 1
        with contextlib.suppress(StoreError):
            self.conn.call(m.TaskDone(client=self.client_id, task=t.task, ok=ok, message=why))

    def copy(self, t: m.NodeTask) -> None:
        """Copy between this node's DRAM segment and SSD file (either direction)."""
        view = self.segment.view
        if self._ssd_fd < 0:
            raise StoreError("this node has no SSD tier")
        if t.src_segment == self.dram_name and t.dst_segment == self.ssd_name:
            self._check(t.src_offset, t.size, self.cfg.dram, t.dst_offset, self._ssd_size)
            n = os.pwrite(self._ssd_fd, view[t.src_offset:t.src_offset + t.size], t.dst_offset)
        elif t.src_segment == self.ssd_name and t.dst_segment == self.dram_name:
            self._check(t.dst_offset, t.size, self.cfg.dram, t.src_offset, self._ssd_size)
            n = os.preadv(self._ssd_fd, [view[t.dst_offset:t.dst_offset + t.size]], t.src_offset)
        else:
            raise StoreError(f"task {t.task} names segments {t.src_segment} -> {t.dst_segment} "
                             "that are not this node's DRAM/SSD pair")
        if n != t.size:
            raise StoreError(f"short copy: {n} of {t.size} bytes")

    @staticmethod
    def _check(dram_off: int, size: int, dram: int, ssd_off: int, ssd: int) -> None:
        if size <= 0 or dram_off < 0 or ssd_off < 0 or dram_off + size > dram or ssd_off + size > ssd:
            raise StoreError(f"tier task range out of bounds (dram {dram_off}+{size}, "
                             f"ssd {ssd_off}+{size})")

    # ------------------------------------------------------------------ shutdown
    def stop(self) -> None:
        self._stop.set()

    def drain(self, timeout_s: float = 0.0) -> int:
        """Stop new placements here; wait up to ``timeout_s`` for objects to leave; returns
        how many are still held."""
        left = 0
        end = time.monotonic() + timeout_s
        while True:
            left = self.conn.call(m.Drain(client=self.client_id, segment=self.dram_name)).n  # type: ignore[attr-defined]
            if left == 0 or time.monotonic() >= end:
                return left
            time.sleep(0.2)

    def close(self, unmount: bool = True) -> None:
        if unmount:
            for msg in self.mounts():
                with contextlib.suppress(StoreError):
                    self.conn.call(m.Unmount(client=self.client_id, segment=msg.segment))
        self.conn.close()
        self.engine.close()
        if self._live_fd >= 0:
            os.close(self._live_fd)
            self._live_fd = -1
        if self._ssd_fd >= 0:
            os.close(self._ssd_fd)
            with contextlib.suppress(OSError):
                os.unlink(self._ssd_path)
