"""Same-host transports: `ShmTransport` copies straight into (or out of) the peer's segment file
mapped into this process; `LocalTransport` serves segments registered by this very engine.

`ShmEndpoint` keeps one TCP control connection per peer (its end-of-file is how a dead peer is
noticed, `_watch`) and maps the peer's files on first access (`liveness.MappedFile`); the
engine asks `ShmEndpoint.stale` before each batch. ``shm_workers`` copy threads (`_Worker`)
copy with `yuebing.transfer.streamcopy.copy` (releasing the GIL), then `confirm` the owner's
lock: DONE only if the owner still held the segment after the copy. Writes are fenced by the
batch deadline (`copy_until`), so a stalled copy thread cannot write after its sender gave up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time

import numpy as np

from yuebing.core.errors import TransferError
from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer import streamcopy
from yuebing.transfer.batch import Slice, complete_slices
from yuebing.transfer.liveness import MappedFile, sweep_dead_segments
from yuebing.transfer.segment import check_range
from yuebing.transfer.transport.base import TRANSPORTS, Endpoint, LocalContext, Transport
from yuebing.transfer.transport.framing import IdleTimeout, recv_frame
from yuebing.transfer.transport.tcp_client import open_socket
from yuebing.transfer.types import OpCode

log = logging.getLogger(__name__)


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


OWNER_GONE = "no owner holds the shared memory of segment"
"""Prefix of `owner_gone` errors: the segment's owner died or unregistered it."""


def owner_gone(name: str, path: str) -> str:
    """The error of a copy into (or out of) a segment file whose owner no longer holds it."""
    return (f"{OWNER_GONE} {name!r} ({path}) any more: its engine died or unregistered it, so "
            "nothing copied there counts")


def confirm(mapped: MappedFile, name: str, errors: list[str | None]) -> list[str | None]:
    """``errors`` of copies through ``mapped``, with the ones that succeeded turned into
    `owner_gone` errors unless the owner still holds the file: called after the copies and
    before they are reported, by the copy threads and the store's direct path."""
    if all(e is not None for e in errors):
        return errors
    try:
        alive = mapped.owner_alive()
    except OSError:
        alive = False
    if alive:
        return errors
    why = owner_gone(name, mapped.path)
    return [why if e is None else e for e in errors]


def copy_slice(s: Slice, remote: np.ndarray, remote_mv: memoryview) -> str | None:
    """Copy one slice between its local buffer and the segment's bytes; the error of a write
    the deadline stopped, else None."""
    end = s.offset + s.length
    if s.op == OpCode.WRITE and time.monotonic() >= s.deadline:
        return expired_write(0, s.length)
    if s.length <= streamcopy.small_copy(s.op == OpCode.READ):
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


class _Worker:
    """Copy threads draining a queue of (mapped segment, slices) items, one per submit."""

    def __init__(self, name: str, threads: int) -> None:
        self.q: queue.SimpleQueue[tuple[MappedFile, list[Slice]] | None] = queue.SimpleQueue()
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
            mapped, slices = item
            errors = copy_all(slices, mapped.arr, mapped.mv)
            complete_slices(slices, confirm(mapped, slices[0].segment, errors))
            self.done(len(slices))

    def done(self, n: int) -> None:
        with self._lock:
            self.outstanding -= n

    def put(self, remote: MappedFile, slices: list[Slice]) -> None:
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
    """Direct copies into a same-host peer's shared-memory segments. The control connection's
    handshake must answer with the descriptor's engine; when it drops, queued slices fail with
    an error naming the peer."""

    def __init__(self, ctx: LocalContext, desc: SegmentDescriptor) -> None:
        self.ctx = ctx
        self.address = desc.address
        self.peer_engine = desc.engine_id
        workers = ctx.config.shm_workers
        self.slice_size = ctx.config.slice_size if workers > 1 else None
        self._maps: dict[str, MappedFile] = {}
        self._lock = threading.Lock()
        self._dead = ""
        self._closed = False
        self._control, reply = open_socket(self.address, ctx, ctx.config.connect_timeout_s)
        if reply.engine_id != self.peer_engine:
            self._control.close()
            raise TransferError(f"peer at {self.address} is engine {reply.engine_id!r}, expected "
                                f"{self.peer_engine!r} (stale segment metadata?)")
        self._control.settimeout(None)
        self._worker = _Worker(f"tx-shm-{self.address}", workers)
        threading.Thread(target=self._watch, name=f"tx-shm-watch-{self.address}",
                         daemon=True).start()

    def _watch(self) -> None:
        """Block on the control connection; the peer never writes to it, so any return means
        it closed (process exit) or broke. Then sweep the segment files left without owner."""
        while True:
            try:
                recv_frame(self._control, idle_ok=True)
            except IdleTimeout:
                continue
            except Exception as e:  # EOF, reset, or an unexpected frame: the peer is gone
                self._mark_dead(f"peer {self.peer_engine} at {self.address} went away ({e})")
                if not self._closed:
                    self._sweep()
                return

    def _sweep(self) -> None:
        """After the peer's death: sweep dead segment files (`sweep_dead_segments`), again
        for a moment while the files this endpoint mapped still have an owner (the kernel may
        close the dead process's socket before it drops the segment's lock)."""
        with self._lock:
            paths = [m.path for m in self._maps.values()]
        for attempt in range(6):
            sweep_dead_segments(self.ctx.config.shm_dir)
            if not any(os.path.exists(p) for p in paths):
                return
            time.sleep(0.02 * 2 ** attempt)

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

    def _remote(self, desc: SegmentDescriptor) -> MappedFile:
        """The mapping of ``desc``'s file (mapped on first use, again when the descriptor names
        another file or size)."""
        mapped = self._maps.get(desc.name)  # fast path without the lock: dict reads are atomic
        if mapped is not None and mapped.path == desc.shm_path and mapped.size == desc.size:
            return mapped
        with self._lock:
            mapped = self._maps.get(desc.name)
            if mapped is not None and mapped.path == desc.shm_path and mapped.size == desc.size:
                return mapped
            try:
                mapped = MappedFile(desc.shm_path, desc.size)
            except OSError as e:
                raise TransferError(f"cannot open shared memory of segment {desc.name!r}: {e}"
                                    ) from None
            self._maps[desc.name] = mapped  # a replaced one is unmapped by the GC when no
            return mapped                   # copy thread uses it any more

    def stale(self, desc: SegmentDescriptor) -> str:
        """Why ``desc`` no longer names a live segment ("" if it does): its file cannot be
        mapped, or its owner no longer holds it (died, or unregistered it — a new incarnation
        has another file); then the mapping is dropped. Called by the engine before each
        batch to this peer (one lock probe, ~1 µs)."""
        try:
            mapped = self._remote(desc)
        except TransferError as e:
            return str(e)
        if mapped.owner_alive():
            return ""
        with self._lock:
            if self._maps.get(desc.name) is mapped:
                del self._maps[desc.name]
        return owner_gone(desc.name, desc.shm_path)

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
            self._maps.clear()  # unmapped and closed when no copy thread uses them any more


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
