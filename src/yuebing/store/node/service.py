"""A storage node (`yuebing store node`, or inside `yuebing serve`): contributes a DRAM segment
(shared memory, registered in the transfer engine: clients READ/WRITE it directly, the node's
CPU never touches put/get bytes) and optionally an SSD tier (one preallocated file) to the
store. It mounts them at the master, heartbeats (re-mounting if the master forgot it), hands on
the commits that land with clients' writes (`landing`), runs the master's tasks between
heartbeats (offload, promotion, drain migrations, each answered with `TaskDone`) and drains its
segments before it unmounts at shutdown.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
import uuid
from collections import deque

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.protocol import Message
from yuebing.protocol import store as m
from yuebing.protocol.store_cluster import (
    Drain,
    DrainStatus,
    Mount,
    NodeTask,
    TaskDone,
    TaskKind,
    Unmount,
)
from yuebing.store.client.rpc import MasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig, NodeConfig
from yuebing.store.node.landing import LandingReports
from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest
from yuebing.transfer.liveness import sweep_dead_segments
from yuebing.transfer.types import BatchId, TransferStatus

log = logging.getLogger(__name__)

CLOSE_S = 1.0
"""Most seconds `StorageNode.close` spends on in-flight migration writes and unmount calls."""
SHM_SWEEP_S = 10.0
"""How often (at heartbeat time) a node sweeps the segment files of dead same-host engines."""


class StorageNode:
    """One node process's store role. `serve` blocks until `stop`.

    A task carries the master's write expiry: the node starts none past it and bounds a migration's
    transfer batch by it, so the master can reuse a lost task's destination later. The expiry counts
    from when the loop last finished reading the master socket before the task's push was read: a
    push that waited in the socket while the loop was busy gets no extra time. The SSD file is
    mapped and registered too, so a reader copies an SSD-resident value from it when the master has
    no DRAM room to promote it. Shutdown drains every segment (the master migrates what would be
    lost while the node runs its tasks), waits until no value is at risk or leased on them (failed
    rounds retried until the deadline), then unmounts and releases the segments."""

    def __init__(self, cfg: NodeConfig, client: ClientConfig | None = None,
                 transfer: TransferConfig | None = None) -> None:
        self.cfg = cfg
        self.ccfg = client or ClientConfig()
        self.name = cfg.name or f"node-{uuid.uuid4().hex[:8]}"
        self.client_id = self.name
        self.incarnation = uuid.uuid4().hex
        """This process: a node restarted under the same name retires the segments of the
        process before it at its first mount (`master.sessions`)."""
        self.engine = TransferEngine(transfer or TransferConfig(metadata="p2p"))
        self._local = f"{self.name}.dram"
        self.segment = self.engine.register_segment(self._local, size=cfg.dram,
                                                    prefault=cfg.prefault)
        self.dram_name = self.engine.segment_name(self._local)
        self._next_sweep = 0.0  # the engine holds the segment's liveness lock while it lives
        self.ssd_name = ""
        self._ssd_fd = -1
        self._ssd_path = ""
        self._ssd_map: mmap.mmap | None = None
        ssd = cfg.ssd_dir_size
        if ssd is not None:
            self._open_ssd(*ssd)
        self.tasks: deque[tuple[NodeTask, float]] = deque()  # (task, monotonic deadline)
        self._heard = time.monotonic()  # when the loop last finished reading the master socket
        # migrations in flight: batch id -> (task, source buffer kept alive until the batch ends)
        self._moving: dict[BatchId, tuple[NodeTask, memoryview]] = {}
        self.conn = MasterConnection(self.ccfg.masters, self.ccfg.rpc_timeout_s,
                                     self.ccfg.failover_s, on_push=self._on_push,
                                     token=cfg.cluster_token, local=self.ccfg.local_socket)
        self.landings = LandingReports(self.name, self.incarnation, lambda: self.conn.address,
                                       self.conn.token, self.engine.segment_name,
                                       self.ccfg.local_socket)
        """Commits that ride on clients' write frames, handed on to the master."""
        self.engine.on_landed(self.landings.landed)
        self._stop = threading.Event()
        self.tasks_done = 0

    def _open_ssd(self, directory: str, size: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self._ssd_path = os.path.join(directory, f"{self.name}.ssd")
        self._ssd_fd = os.open(self._ssd_path, os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(self._ssd_fd, size)
        self._ssd_size = size
        # readers copy SSD-tier values straight from the file when the master has no DRAM
        # room for a promotion: the file is a (TCP) segment of the transfer engine too
        self._ssd_map = mmap.mmap(self._ssd_fd, size)
        self.engine.register_segment(f"{self.name}.ssd", buffer=self._ssd_map)
        self.ssd_name = self.engine.segment_name(f"{self.name}.ssd")

    def mounts(self) -> list[Mount]:
        out = [Mount(client=self.client_id, segment=self.dram_name, size=self.cfg.dram,
                       tier=m.Tier.DRAM, node=self.name, incarnation=self.incarnation)]
        if self.ssd_name:
            out.append(Mount(client=self.client_id, segment=self.ssd_name,
                               size=self._ssd_size, tier=m.Tier.SSD, node=self.name,
                               incarnation=self.incarnation))
        return out

    def mount(self) -> None:
        for msg in self.mounts():
            self._call(msg)
        log.warning("node %s mounted %s", self.name, [x.segment for x in self.mounts()])

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.mount()
        next_hb = 0.0
        while not self._stop.is_set():
            next_hb = self._step(next_hb)

    def _step(self, next_hb: float, wait_s: float = 0.05) -> float:
        """One turn of the loop (serve and drain): heartbeat when due, master pushes, tasks,
        finished migrations. Returns the next heartbeat time."""
        now = time.monotonic()
        if now >= next_hb:
            self._heartbeat()
            next_hb = now + self.ccfg.heartbeat_s
        wait = 0.005 if self._moving else wait_s
        try:
            self.conn.poll_pushes(max(0.0, min(wait, next_hb - time.monotonic())))
        finally:
            self._heard = time.monotonic()
        while self.tasks:
            self._run_task(*self.tasks.popleft())
        if self._moving:
            self._reap_migrations()
        return next_hb

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:  # files of same-host engines that died (kill -9 too)
            self._next_sweep = now + SHM_SWEEP_S
            sweep_dead_segments(self.engine.config.shm_dir)
        try:
            r = self._call(m.Heartbeat(client=self.client_id, incarnation=self.incarnation))
        except StoreRpcError as e:
            if e.code == m.Code.EXISTS:  # another process took this name over: stop
                log.error("node %s stops: %s", self.name, e)
                self._stop.set()
                return
            log.warning("heartbeat failed: %s", e)
            return
        except StoreError as e:
            log.warning("heartbeat failed: %s", e)
            return
        have = set(r.segments)  # type: ignore[attr-defined]
        for msg in self.mounts():
            if msg.segment not in have:
                log.warning("master does not know %s; mounting again", msg.segment)
                with contextlib.suppress(StoreError):
                    self._call(msg)

    def _call(self, msg: Message) -> Message:
        """``conn.call``, noting when it finished reading the master socket (`_on_push`)."""
        try:
            return self.conn.call(msg)
        finally:
            self._heard = time.monotonic()

    def _on_push(self, msg: Message) -> None:
        """A master push, handed over while `_step` polls or `_call` waits for a reply. A task's
        deadline counts from ``_heard`` (the end of the read before this one), which is no
        later than the push's arrival however long the loop was busy before reading it."""
        if isinstance(msg, NodeTask):
            limit = msg.expires_in_s if msg.expires_in_s > 0 else float("inf")
            self.tasks.append((msg, self._heard + limit))

    def _run_task(self, t: NodeTask, deadline: float) -> None:
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise StoreError(f"task {t.task} reached its write expiry before it started")
            if t.kind == TaskKind.MIGRATE:
                self._start_migration(t, left)
                return
            self.copy(t)
        except (OSError, ValueError, StoreError, TransferError) as e:
            log.error("task %d (%s) failed: %s", t.task, _kind_name(t.kind), e)
            self._done(t, False, str(e))
            return
        self._done(t, True, "")

    def _done(self, t: NodeTask, ok: bool, why: str) -> None:
        self.tasks_done += 1
        with contextlib.suppress(StoreError):
            self._call(TaskDone(client=self.client_id, task=t.task, ok=ok, message=why))

    def _start_migration(self, t: NodeTask, left_s: float) -> None:
        """Submit the write of our replica to ``t.dst_segment`` as a batch ending within
        ``left_s`` (the task's write expiry; its frames carry it, so the destination refuses
        them after it); `_reap_migrations` reports it."""
        if t.size <= 0 or t.src_offset < 0:
            raise StoreError(f"migration task {t.task} has a bad range ({t.src_offset}+{t.size})")
        if t.src_segment == self.dram_name:
            if t.src_offset + t.size > self.cfg.dram:
                raise StoreError(f"migration source {t.src_offset}+{t.size} is outside the "
                                 f"DRAM segment ({self.cfg.dram} bytes)")
            src = self.segment.view[t.src_offset:t.src_offset + t.size]
        elif self.ssd_name and t.src_segment == self.ssd_name:
            if t.src_offset + t.size > self._ssd_size:
                raise StoreError(f"migration source {t.src_offset}+{t.size} is outside the "
                                 f"SSD file ({self._ssd_size} bytes)")
            src = memoryview(bytearray(t.size))
            n = os.preadv(self._ssd_fd, [src], t.src_offset)
            if n != t.size:
                raise StoreError(f"short SSD read: {n} of {t.size} bytes")
        else:
            raise StoreError(f"migration task {t.task} reads {t.src_segment!r}, which is not "
                             "one of this node's segments")
        req = TransferRequest(OpCode.WRITE, src, t.dst_segment, t.dst_offset, t.size)
        try:
            bid = self.engine.submit([req], min(self.ccfg.transfer_timeout_s, left_s))
        except InputError as e:
            raise StoreError(f"cannot write to {t.dst_segment!r}: {e}") from e
        self._moving[bid] = (t, src)

    def _reap_migrations(self) -> None:
        for bid in list(self._moving):
            st = self.engine.status(bid)
            if st.status < TransferStatus.DONE:
                continue
            t, _ = self._moving.pop(bid)
            self.engine.free(bid)
            ok = st.status == TransferStatus.DONE
            why = "" if ok else f"write to {t.dst_segment}: {'; '.join(st.errors) or st.status.name}"
            if not ok:
                log.error("migration task %d failed: %s", t.task, why)
            self._done(t, ok, why)

    def copy(self, t: NodeTask) -> None:
        """Copy between this node's DRAM segment and SSD file (OFFLOAD / PROMOTE tasks)."""
        if t.kind not in (TaskKind.OFFLOAD, TaskKind.PROMOTE):
            raise StoreError(f"task {t.task} has unknown kind {t.kind}")
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
    def stop(self, drain_s: float | None = None) -> None:
        """End `serve` (called by a signal handler, say). With ``drain_s``, every master call
        from now on ends within that many seconds — the call in flight too (`rpc` waits in
        slices while a deadline is set) — so a stop while the master is unreachable is not
        held up by RPC timeouts and failover retries; `drain` keeps to the same deadline."""
        if drain_s is not None:
            self.conn.deadline = min(self.conn.deadline, time.monotonic() + drain_s)
        self._stop.set()

    def drain(self, timeout_s: float = 0.0) -> int:
        """Drain every segment of this node (called at shutdown, after `serve` returned): the
        master stops placing values here and migrates those that would be lost to other
        segments, through migration tasks this loop keeps running (and heartbeats). Waits up
        to ``timeout_s`` until the master counts no value at risk and no value a reader still
        leases on these segments. A round that fails (`StoreError`: failover, RPC timeout) is
        logged and tried again until the deadline. Returns the values still at risk (0:
        unmounting now loses no committed value; -1: the master never answered, unknown).
        Every master call (drain rounds, heartbeats, task reports) ends by the deadline (the
        earlier of ``timeout_s`` from now and the one `stop` set), whatever the master's state;
        what could not be migrated is logged (`_report_unmigrated`)."""
        end = min(time.monotonic() + timeout_s, self.conn.deadline)
        self.conn.deadline = end
        next_hb = time.monotonic() + self.ccfg.heartbeat_s
        at_risk, leased, sample, why = -1, -1, [], ""
        while time.monotonic() < end:
            try:
                counts = [self._drain_one(x.segment) for x in self.mounts()]
                at_risk = sum(c[0] for c in counts)
                leased = -1 if at_risk else sum(c[1] for c in counts)
                sample = [k for c in counts for k in c[2]]
            except StoreError as e:
                why = str(e)
                log.warning("node %s: drain round failed (%s); trying again", self.name, e)
            if (at_risk == 0 and leased == 0) or time.monotonic() >= end:
                break
            poll_end = min(end, time.monotonic() + 0.2)
            while time.monotonic() < poll_end:
                next_hb = self._step(next_hb, wait_s=poll_end - time.monotonic())
        if at_risk:
            self._report_unmigrated(at_risk, sample, why, timeout_s)
        elif leased:
            log.warning("node %s: unmounting while readers may still lease %s values here",
                        self.name, leased)
        return at_risk

    def _drain_one(self, segment: str) -> tuple[int, int, list[str]]:
        """One `Drain` of ``segment``: (values at risk, values leased (-1 = not counted), some
        keys at risk)."""
        try:
            reply = self._call(Drain(client=self.client_id, segment=segment,
                                       incarnation=self.incarnation))
        except StoreRpcError as e:
            if e.code == m.Code.UNKNOWN_SEGMENT:
                return 0, 0, []  # the master holds nothing of it (never mounted, or dropped)
            raise
        if not isinstance(reply, DrainStatus):
            raise StoreError(f"Drain of {segment} answered {type(reply).__name__}")
        return reply.at_risk, reply.leased, reply.keys

    def _report_unmigrated(self, at_risk: int, sample: list[str], why: str,
                           timeout_s: float) -> None:
        """Log what the drain could not migrate: how many values (or that the master never
        answered, so nobody knows), a few of their keys, and the segments they are lost with."""
        segs = ", ".join(f"{x.segment} ({x.size} bytes)" for x in self.mounts())
        if at_risk < 0:
            log.error("node %s: could not drain within %.1fs: the master did not answer (%s); "
                      "unmounting %s as they are: values stored only here are lost (how many "
                      "is unknown)", self.name, timeout_s, why or "no reply", segs)
            return
        log.error("node %s: %d values could not be migrated within %.1fs%s and are lost with "
                  "%s%s", self.name, at_risk, timeout_s, f" (last error: {why})" if why else
                  " (no room elsewhere, or copies still in flight)", segs,
                  f"; among them: {', '.join(sample)}" if sample else "")

    def close(self, unmount: bool = True) -> None:
        """Release everything within `CLOSE_S`: migration writes in flight may end (their
        destinations stay fenced at the master until their write expiry), the segments are
        unmounted (a master that does not answer by then forgets them at the session's TTL)."""
        end = time.monotonic() + CLOSE_S
        self.conn.deadline = end
        for bid in list(self._moving):  # let in-flight writes end before the engine closes
            self.engine.wait(bid, max(0.0, end - time.monotonic()))
        self._moving.clear()
        if unmount:
            for msg in self.mounts():
                with contextlib.suppress(StoreError):
                    self._call(Unmount(client=self.client_id, segment=msg.segment,
                                         incarnation=self.incarnation))
        self.conn.close()
        self.engine.on_landed(None)
        self.engine.close()
        self.landings.close()
        if self._ssd_map is not None:
            with contextlib.suppress(BufferError):  # a view still exported: unmapped at exit
                self._ssd_map.close()
            self._ssd_map = None
        if self._ssd_fd >= 0:
            os.close(self._ssd_fd)
            with contextlib.suppress(OSError):
                os.unlink(self._ssd_path)


def _kind_name(kind: int) -> str:
    try:
        return TaskKind(kind).name.lower()
    except ValueError:
        return f"kind {kind}"
