"""Same-host transports: `ShmTransport` copies straight into (or out of) the peer's segment file
mapped into this process; `LocalTransport` serves segments registered by this very engine.

Life cycle of a shared-memory slice: on first use of a peer, `ShmEndpoint` opens one TCP control
connection to it (handshake; its end-of-file is how a dead peer is noticed) and maps each of the
peer's segment files on first access. `submit` queues slices for ``shm_workers`` copy threads; a
worker re-checks the range against the published descriptor and copies with
`yuebing.transfer.streamcopy.copy` (streaming stores; releases the GIL), then completes the slice. Writes are fenced: a write slice is not
started past its batch deadline and large ones are copied in `FENCE_CHUNK` pieces with the
deadline checked between them, so a stalled copy thread cannot write after its sender gave up. No kernel socket carries the bytes. When the
control connection drops, queued slices fail with an error naming the peer and the maps close.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import threading
import time

import numpy as np

from yuebing.core.errors import TransferError
from yuebing.transfer import streamcopy
from yuebing.transfer.batch import Slice, complete_slices
from yuebing.transfer.messages import SegmentDescriptor
from yuebing.transfer.segment import check_range
from yuebing.transfer.transport.base import TRANSPORTS, Endpoint, LocalContext, Transport
from yuebing.transfer.transport.framing import IdleTimeout, recv_frame
from yuebing.transfer.transport.tcp_client import open_socket
from yuebing.transfer.types import OpCode

log = logging.getLogger(__name__)


SMALL_COPY = 256 << 10
"""Slices up to this size are copied with a memoryview assignment (cheapest call, holds the
GIL for a few µs); larger ones with `streamcopy.copy`, which releases the GIL while it copies."""


FENCE_CHUNK = 8 << 20
"""Writes are copied in pieces of at most this many bytes with the deadline checked before
each (`copy_until`): the write fence of the shared-memory paths (a few ms past the deadline
at most; the store's master keeps revoked space unused for longer)."""


def copy_until(dst: np.ndarray, src: np.ndarray, deadline: float) -> int:
    """Copy ``src`` into ``dst`` (same size) in `FENCE_CHUNK` pieces, none started after
    ``deadline`` (``time.monotonic()``); returns the bytes copied (all of them unless the
    deadline passed). Used for writes by the shm copy threads and the store's direct path."""
    n = src.nbytes
    for start in range(0, n, FENCE_CHUNK):
        if time.monotonic() >= deadline:
            return start
        stop = min(n, start + FENCE_CHUNK)
        streamcopy.copy(dst[start:stop], src[start:stop])
    return n


EXPIRED_WRITE = "write expired: deadline passed"
"""Prefix of `expired_write` errors: the writer was late, the target is fine."""


def expired_write(done: int, length: int) -> str:
    """The error of a write the fence stopped after ``done`` of ``length`` bytes."""
    return f"{EXPIRED_WRITE} after {done} of {length} bytes were copied"


def copy_slice(s: Slice, remote: np.ndarray, remote_mv: memoryview) -> str | None:
    """Copy one slice between its local buffer and the segment's bytes; the error of a write
    the deadline stopped, else None."""
    end = s.offset + s.length
    if s.op == OpCode.WRITE and time.monotonic() >= s.deadline:
        return expired_write(0, s.length)
    if s.length <= SMALL_COPY:
        if s.op == OpCode.WRITE:
            remote_mv[s.offset:end] = s.local
        else:
            s.local[:] = remote_mv[s.offset:end]
        return None
    local = np.frombuffer(s.local, dtype=np.uint8)
    if s.op == OpCode.WRITE:
        done = copy_until(remote[s.offset:end], local, s.deadline)
        return None if done == s.length else expired_write(done, s.length)
    streamcopy.copy(local, remote[s.offset:end])
    return None


def copy_all(slices: list[Slice], remote: np.ndarray, remote_mv: memoryview) -> list[str | None]:
    """Copy every live slice in one tight loop; the per-slice errors (None = copied) for
    `complete_slices`, which then updates the batch once."""
    errors: list[str | None] = []
    for s in slices:
        error = None
        if s.live:
            try:
                error = copy_slice(s, remote, remote_mv)
            except (ValueError, OSError) as e:
                error = f"shared-memory copy failed: {e}"
        errors.append(error)
    return errors


Remote = tuple[np.ndarray, memoryview]
"""A mapped peer segment as a numpy array and a memoryview of the same bytes."""


class _Worker:
    """Copy threads draining a queue of (remote segment, slices) items, one per submit."""

    def __init__(self, name: str, threads: int) -> None:
        self.q: queue.SimpleQueue[tuple[Remote, list[Slice]] | None] = queue.SimpleQueue()
        self.outstanding = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            (remote, remote_mv), slices = item
            complete_slices(slices, copy_all(slices, remote, remote_mv))
            self.done(len(slices))

    def done(self, n: int) -> None:
        with self._lock:
            self.outstanding -= n

    def put(self, remote: Remote, slices: list[Slice]) -> None:
        """Queue ``slices`` (spread over the copy threads in chunks when there are several)."""
        with self._lock:
            self.outstanding += len(slices)
        step = max(1, -(-len(slices) // len(self._threads)))
        for i in range(0, len(slices), step):
            self.q.put((remote, slices[i:i + step]))

    def stop(self) -> None:
        for _ in self._threads:
            self.q.put(None)


class ShmEndpoint(Endpoint):
    """Direct copies into a same-host peer's shared-memory segments."""

    def __init__(self, ctx: LocalContext, desc: SegmentDescriptor) -> None:
        self.ctx = ctx
        self.address = desc.address
        self.peer_engine = desc.engine_id
        workers = ctx.config.shm_workers
        self.slice_size = ctx.config.slice_size if workers > 1 else None
        self._maps: dict[str, tuple[str, mmap.mmap, Remote]] = {}
        self._lock = threading.Lock()
        self._dead = ""
        self._closed = False
        self._control, _ = open_socket(self.address, ctx, ctx.config.connect_timeout_s)
        self._control.settimeout(None)
        self._worker = _Worker(f"tx-shm-{self.address}", workers)
        threading.Thread(target=self._watch, name=f"tx-shm-watch-{self.address}",
                         daemon=True).start()

    def _watch(self) -> None:
        """Block on the control connection; the peer never writes to it, so any return means
        it closed (process exit) or broke."""
        while True:
            try:
                recv_frame(self._control, idle_ok=True)
            except IdleTimeout:
                continue
            except Exception as e:  # EOF, reset, or an unexpected frame: the peer is gone
                self._mark_dead(f"peer {self.peer_engine} at {self.address} went away ({e})")
                return

    def _mark_dead(self, error: str) -> None:
        self._dead = self._dead or error
        if not self._closed:
            log.info("shared-memory peer lost: %s", error)
        while True:
            try:
                item = self._worker.q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._worker.done(len(item[1]))
                for sl in item[1]:
                    sl.complete(self._dead)
        self._worker.stop()

    def _remote(self, desc: SegmentDescriptor) -> Remote:
        with self._lock:
            entry = self._maps.get(desc.name)
            if entry is not None and entry[0] == desc.shm_path and entry[2][1].nbytes == desc.size:
                return entry[2]
            try:
                fd = os.open(desc.shm_path, os.O_RDWR)
            except OSError as e:
                raise TransferError(f"cannot open shared memory of segment {desc.name!r}: {e}") from None
            try:
                if os.fstat(fd).st_size < desc.size:
                    raise TransferError(f"shared memory of segment {desc.name!r} is smaller than "
                                        f"its descriptor says ({desc.size} bytes)")
                m = mmap.mmap(fd, desc.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            remote = (np.frombuffer(m, dtype=np.uint8), memoryview(m))
            self._maps[desc.name] = (desc.shm_path, m, remote)
            return remote

    @property
    def alive(self) -> bool:
        return not self._dead and not self._closed

    @property
    def busy(self) -> bool:
        return self._worker.outstanding > 0

    def submit(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        try:
            if self._dead:
                raise TransferError(self._dead)
            remote = self._remote(desc)
        except TransferError as e:
            for s in slices:
                s.complete(str(e))
            return
        ok = []
        for sl in slices:
            try:
                check_range(desc.name, desc.size, sl.span[0], sl.span[1])
            except TransferError as e:
                sl.complete(str(e))
                continue
            ok.append(sl)
        if ok:
            ok[0].batch.started_many({sl.index for sl in ok})
            self._worker.put(remote, ok)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._control.close()
        self._mark_dead(f"endpoint to {self.address} closed")
        with self._lock:
            self._maps.clear()  # the mmaps close when the last numpy view is collected


@TRANSPORTS.register("shm")
class ShmTransport(Transport):
    """Shared memory: reaches shm-backed segments of other engines on the same host."""

    name = "shm"

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        return bool(desc.shm_path) and desc.host_id == self.ctx.host_id

    def connect(self, desc: SegmentDescriptor) -> ShmEndpoint:
        return ShmEndpoint(self.ctx, desc)


class LocalEndpoint(Endpoint):
    """Copies to and from this engine's own segments, in the submitting thread."""

    slice_size = None

    def __init__(self, ctx: LocalContext) -> None:
        self.ctx = ctx

    @property
    def alive(self) -> bool:
        return True

    @property
    def busy(self) -> bool:
        return False

    def submit(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        """Copy in place, then update the batch once for all ``slices``."""
        errors: list[str | None] = []
        resolve = self.ctx.segments.resolve
        for s in slices:
            try:
                view = resolve(s.segment, s.offset, s.length, s.span)
            except TransferError as e:
                errors.append(str(e))
                continue
            if s.op == OpCode.WRITE:
                view[:] = s.local
            else:
                s.local[:] = view
            errors.append(None)
        complete_slices(slices, errors)

    def close(self) -> None:
        pass


@TRANSPORTS.register("local")
class LocalTransport(Transport):
    """This engine's own segments (any memory, shm or not)."""

    name = "local"

    def can_reach(self, desc: SegmentDescriptor) -> bool:
        return desc.engine_id == self.ctx.engine_id

    def connect(self, desc: SegmentDescriptor) -> LocalEndpoint:
        return LocalEndpoint(self.ctx)
