"""Same-host fast path: copy values straight into / out of a storage node's shared-memory
segment mapped into the client, with no transfer-engine batch, queue or worker hand-off.

Life cycle: the first request for a segment looks up its descriptor through the client's
transfer engine (``describe``). A segment on another host, without a shared-memory file, or on
an engine not allowed to use ``shm`` is remembered as "not direct" and its requests go through
the engine as before. Otherwise the file is mapped once and kept open. The storage node holds an
exclusive ``flock`` on that file for as long as it lives (`hold_liveness_lock`); before each
batch of copies the client tries a shared, non-blocking lock: if it gets one, no node holds the
file (the node died), so the map is dropped and the requests go through the engine, which
fails them and lets the put be revoked and placed elsewhere. Copies use
`yuebing.transfer.streamcopy.copy` (streaming stores, releases the GIL) above `SMALL_COPY` bytes, memoryview assignment below; a batch of at least
`PARALLEL_MIN` bytes is split over a few copy threads. Writes are fenced like the engine's: none
starts after the put's deadline and large ones are copied in pieces with it checked between
them (`copy_until`); a write cut short ends TIMEOUT and the put is revoked. A read that ends
past its deadline (the read lease's, less a margin) ends TIMEOUT too: the client asks again.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from yuebing.core.errors import TransferError
from yuebing.transfer import (
    BatchStatus,
    OpCode,
    TransferEngine,
    TransferRequest,
    TransferStatus,
    streamcopy,
)
from yuebing.transfer.transport.shm import copy_until, expired_write
from yuebing.transfer.types import BatchId, RequestStatus

log = logging.getLogger(__name__)

SMALL_COPY = 256 << 10
PARALLEL_MIN = 4 << 20
"""Batches of at least this many bytes are copied by several threads."""

LATE_READ = "read ended past its deadline: its read lease may have ended mid-copy"


def hold_liveness_lock(path: str) -> int:
    """Called by the storage node once its segment exists: take an exclusive lock on the
    segment file, held (with the returned fd) until the process ends. Clients treat a segment
    whose file nobody locks as dead."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class _Mapped:
    __slots__ = ("arr", "fd", "mm", "mv", "size")

    def __init__(self, path: str, size: int) -> None:
        self.fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(self.fd).st_size < size:
                raise TransferError(f"shared memory file {path} is smaller than {size} bytes")
            self.mm = mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.arr = np.frombuffer(self.mm, dtype=np.uint8)
        self.mv = memoryview(self.mm)

    def owner_alive(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # the node's exclusive lock is held
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def close(self) -> None:
        self.mv.release()
        del self.arr
        with contextlib.suppress(BufferError):
            self.mm.close()  # BufferError: a caller still holds a view; GC unmaps
        os.close(self.fd)


class DirectSegments:
    """Maps of same-host node segments; `copy` performs the requests it can serve directly."""

    def __init__(self, engine: TransferEngine, enabled: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled and "shm" in engine.config.transports
        self._maps: dict[str, _Mapped | None] = {}
        self._lock = threading.Lock()
        self.workers = min(4, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    def _map(self, segment: str) -> _Mapped | None:
        with self._lock:
            if segment in self._maps:
                return self._maps[segment]
            mapped = None
            try:
                d = self.engine.describe(segment)
                if d.shm_path and d.host_id == self.engine.host_id:
                    mapped = _Mapped(d.shm_path, d.size)
            except (OSError, TransferError) as e:
                log.info("segment %s is not directly mappable: %s", segment, e)
            self._maps[segment] = mapped
            return mapped

    def _forget(self, segment: str) -> None:
        with self._lock:
            mapped = self._maps.pop(segment, None)
        if mapped is not None:
            mapped.close()

    def copy(self, reqs: list[TransferRequest], deadline: float) -> list[RequestStatus | None]:
        """Copy every request whose segment is mapped here and whose node is alive, writes
        only until ``deadline`` (``time.monotonic()``); returns each one's status (DONE, or
        TIMEOUT for a write the deadline cut or a read that ended past it — the lease behind a
        read's deadline may have ended mid-copy, so its bytes are not trusted), None for those
        left to the transfer engine.
        Requests were built by the store client: contiguous memoryviews, ``length`` set."""
        done: list[RequestStatus | None] = [None] * len(reqs)
        if not self.enabled:
            return done
        live: dict[str, _Mapped | None] = {}
        jobs: list[tuple[OpCode, memoryview, _Mapped, int, int]] = []
        index: list[int] = []
        for i, r in enumerate(reqs):
            seg = str(r.segment)
            if seg not in live:
                mapped = self._map(seg)
                if mapped is not None and not mapped.owner_alive():
                    log.warning("segment %s: no node holds it any more; unmapping", seg)
                    self._forget(seg)
                    mapped = None
                live[seg] = mapped
            mapped = live[seg]
            n = r.length
            if mapped is None or n is None or r.offset + n > mapped.size:
                continue  # the engine reports the range error
            jobs.append((r.op, r.local, mapped, r.offset, n))  # type: ignore[arg-type]
            index.append(i)
        results = self._run(jobs, deadline)
        late = time.monotonic() >= deadline
        for i, job, copied in zip(index, jobs, results, strict=True):
            n = job[4]
            if job[0] == OpCode.READ and late:  # e.g. preempted mid-copy past the read lease
                done[i] = RequestStatus(TransferStatus.TIMEOUT, copied, n, LATE_READ)
            elif copied == n:
                done[i] = RequestStatus(TransferStatus.DONE, n, n)
            else:
                done[i] = RequestStatus(TransferStatus.TIMEOUT, copied, n, expired_write(copied, n))
        return done

    def _run(self, jobs: list[tuple[OpCode, memoryview, _Mapped, int, int]],
             deadline: float) -> list[int]:
        """Copy in this thread, or, for a batch of at least `PARALLEL_MIN` bytes, split over
        `workers` threads (`streamcopy.copy` releases the GIL: copies overlap); returns the
        bytes each job copied."""
        if len(jobs) < 2 or self.workers < 2 or sum(j[4] for j in jobs) < PARALLEL_MIN:
            return _copy_all(jobs, deadline)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="store-direct")
        k = self.workers
        groups = [jobs[g::k] for g in range(k)]
        futs = [self._pool.submit(_copy_all, g, deadline) for g in groups[1:]]
        copied = [0] * len(jobs)
        copied[0::k] = _copy_all(groups[0], deadline)
        for g, f in enumerate(futs, start=1):
            copied[g::k] = f.result()
        return copied

    @staticmethod
    def merged(results: list[RequestStatus | None], status: BatchStatus | None) -> BatchStatus:
        """One status per request: ``results`` where copied directly, the engine's (``status``
        of the other requests, in order) elsewhere; the batch's is the worst of them."""
        it = iter(status.requests if status is not None else ())
        out = tuple(r if r is not None else next(it) for r in results)
        codes = {r.status for r in out}
        worst = next((c for c in (TransferStatus.TIMEOUT, TransferStatus.FAILED) if c in codes),
                     TransferStatus.DONE)
        if status is not None and status.status < TransferStatus.DONE:
            worst = status.status
        return BatchStatus(status.batch_id if status is not None else BatchId(0), worst, out)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        with self._lock:
            maps, self._maps = self._maps, {}
        for mapped in maps.values():
            if mapped is not None:
                mapped.close()


def _copy_all(jobs: list[tuple[OpCode, memoryview, _Mapped, int, int]],
              deadline: float) -> list[int]:
    return [_copy(*job, deadline) for job in jobs]


def _copy(op: OpCode, local: memoryview, mapped: _Mapped, off: int, n: int,
          deadline: float) -> int:
    """Copy one request; returns the bytes copied (a write stops at ``deadline``)."""
    if op == OpCode.WRITE and time.monotonic() >= deadline:
        return 0
    if n <= SMALL_COPY:
        if op == OpCode.WRITE:
            mapped.mv[off:off + n] = local[:n]
        else:
            local[:n] = mapped.mv[off:off + n]
        return n
    mine = np.frombuffer(local, dtype=np.uint8, count=n)
    if op == OpCode.WRITE:
        return copy_until(mapped.arr[off:off + n], mine, deadline)
    streamcopy.copy(mine, mapped.arr[off:off + n])
    return n
