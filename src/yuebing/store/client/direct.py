"""The client's side of a transfer, for both store clients' steps (`core`): the same-host fast
path (`DirectSegments`: values copied straight into / out of a node's shared-memory segment
mapped here, no transfer-engine batch), the deadlines every transfer of a put or get keeps
(`transfer_timeout`: `WriteExpired`, `LeaseExpired`) and the buffers of the values a get
returns (`new_buffer`, `keep_freed_memory`: no zero-fill, and freed buffers kept in the heap,
so a multi-MiB read does not pay page faults as long as the transfer itself).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import numpy as np

from yuebing.core import env
from yuebing.core.choices import kept_choice, machine_parts, shared_choice
from yuebing.core.errors import TransferError
from yuebing.store.config import ClientConfig
from yuebing.transfer import (
    BatchStatus,
    OpCode,
    TransferEngine,
    TransferRequest,
    TransferStatus,
    streamcopy,
)
from yuebing.transfer.liveness import MappedFile
from yuebing.transfer.transport.shm import confirm, copy_until, expired_write
from yuebing.transfer.types import BatchId, RequestStatus

log = logging.getLogger(__name__)

SPLIT_CANDIDATES = (512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20, 32 << 20, 64 << 20)
"""Copy sizes the split limits are measured at (`measure_split`): up to a batch of 16 × 4 MiB."""
SPLIT_VERSION = 4
"""Bump when the measurement changes: every machine measures again."""
NEVER = 1 << 62
KINDS = ("write", "read", "fresh")
"""What `measure_split` times: writes into touched segment memory (a batch's limit), reads
into one reused buffer (a single read's), reads into private memory not yet faulted in (``fresh``: a
get's new buffers; page faults, which threads take in parallel). A node prefaults its segment
(`NodeConfig.prefault`), so writes into it count as warm."""


class SplitLimits(NamedTuple):
    """Bytes from which `DirectSegments` splits a copy over its threads (`NEVER`: never)."""

    batch: int
    """A batch (writes, and reads into warm buffers), split job by job."""
    read: int
    """One read into a warm buffer, cut in a piece per thread."""
    fresh: int
    """A batch or one read whose destination is not faulted in yet (`resident`)."""


_PAGE = mmap.PAGESIZE
_libc: Any
try:
    _libc = ctypes.CDLL(None, use_errno=True)  # the C library this process runs
except OSError:
    _libc = None
_mincore: Any
try:
    _mincore = _libc.mincore
    _mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
except AttributeError:  # not glibc/Linux: every destination counts as warm
    _mincore = None


def resident(addr: int) -> bool:
    """Whether the page holding address ``addr`` is in memory (``mincore``; True where it
    cannot be asked): a destination that is not faults page by page as it is copied into."""
    if _mincore is None:
        return True
    vec = ctypes.create_string_buffer(1)
    return _mincore(addr - addr % _PAGE, 1, vec) != 0 or bool(vec.raw[0] & 1)


def default_workers() -> int:
    """Copy threads of a `DirectSegments` (this one included)."""
    return min(4, os.cpu_count() or 1)


WHOLE = SplitLimits(NEVER, NEVER, NEVER)
"""Every copy whole, on its caller: while nothing is kept for this machine and its limits are
measured, and for good where that measurement failed."""


class _Split:
    """This process's `SplitLimits`: a quiet kept choice at once; else a background thread
    settles them (`shared_choice`: measured, or measured again on a quiet host; ~4 s and
    ~384 MiB for a while) and copies meanwhile use the provisional kept limits or `WHOLE`,
    unless the caller waits (`split_limits`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.limits: SplitLimits | None = None
        """Settled: the kept or measured limits (`interim` where the measurement failed)."""
        self.interim = WHOLE
        """Used until `limits` is settled: the provisional kept limits, or `WHOLE`."""
        self.thread: threading.Thread | None = None

    def get(self, workers: int, wait: bool) -> SplitLimits:
        """The limits now: settled, or `interim` while the thread measures them (started by
        the first call; ``wait``: joined instead)."""
        if self.limits is not None:  # settled: every copy's path, no lock
            return self.limits
        with self.lock:
            if self.limits is None and self.thread is None:
                parts = _split_parts(workers)
                kept = kept_choice(parts, split_choice)
                if kept is not None and (kept[1] or env.keep_choices()):
                    self._settled(*kept[0], True)
                else:
                    self.interim = kept[0][0] if kept is not None else WHOLE
                    thread = threading.Thread(target=self._settle, args=(parts, workers),
                                              name="yuebing-split-limits", daemon=True)
                    try:
                        thread.start()
                    except RuntimeError as e:  # no threads left (or exiting)
                        self._failed(e)
                        return self.interim
                    self.thread = thread
            thread_now = self.thread
        if wait and thread_now is not None:
            thread_now.join()
        return self.limits or self.interim

    def _settle(self, parts: dict[str, object], workers: int) -> None:
        """The thread's work: settle the limits (a failure leaves `interim` for good)."""
        try:
            (limits, timings), kept = shared_choice(parts, lambda: measure_split(workers),
                                                    split_choice)
        except Exception as e:  # e.g. no memory for the arena
            self._failed(e)
            return
        self._settled(limits, timings, kept)

    def _failed(self, e: BaseException) -> None:
        """Not measured: copies stay at `interim` for good."""
        if not sys.is_finalizing():  # an exit cut it short: nothing to say
            log.warning("split limits not measured (%s); copies use %s", e, self.interim)
        self.limits = self.interim

    def _settled(self, limits: SplitLimits, timings: dict[str, dict[str, list[float]]],
                 kept: bool) -> None:
        log.info("split copies from (bytes; %d = never): %s (%s); µs per copy, one thread / "
                 "split: %s", NEVER, limits, "kept for this machine" if kept else
                 "measured now", timings)
        self.limits = limits


_split = _Split()


def _after_fork() -> None:
    """A child forked while the limits were measured has no thread measuring: it starts
    afresh (settled limits carry over)."""
    global _split
    if _split.limits is None:
        _split = _Split()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def split_limits(workers: int, wait: bool = False) -> SplitLimits:
    """This machine's `SplitLimits` for ``workers`` copy threads, measured once per machine
    and kept (`core.choices`): where a pool thread's wake-up costs more than the split saves
    depends on the processor (2-core Xeon, quiet A/B: same-host `get_into` 4 MiB 1.20×, 1 MiB
    0.80× split; a 2-vCPU Zen 5 VM gains nothing on warm memory, 1.6× on a batch `get`'s new
    buffers). Measured on a background thread (`_Split`) unless ``wait``: a `StoreClient`
    waits (its start is not timed beside the measurement), an `AsyncStoreClient` does not
    (its event loop must not stall ~4 s)."""
    return _split.get(workers, wait)


def _split_parts(workers: int) -> dict[str, object]:
    """What the kept split limits are keyed by (`core.choices`)."""
    return {"kind": "store.split_copy", "version": SPLIT_VERSION, **machine_parts(),
            "workers": workers, "candidates": SPLIT_CANDIDATES,
            "streaming": streamcopy.streaming()}


def split_choice(raw: Any) -> tuple[SplitLimits, dict[str, dict[str, list[float]]]]:
    """`measure_split`'s (limits, timings) from JSON: each limit a candidate or `NEVER`, a
    (whole, split) pair of µs per kind and candidate."""
    limits, timings = raw
    allowed = {*SPLIT_CANDIDATES, NEVER}
    sizes = {str(n) for n in SPLIT_CANDIDATES}
    if not isinstance(limits, list) or len(limits) != len(SplitLimits._fields) or not all(
            type(x) is int and x in allowed for x in limits) or not isinstance(timings, dict) \
            or set(timings) != set(KINDS) or not all(
                isinstance(v, dict) and set(v) == sizes and all(
                    isinstance(t, list) and len(t) == 2 for t in v.values())
                for v in timings.values()):
        raise TypeError(f"not a split-copy choice: {raw!r}")
    return SplitLimits(*limits), {k: {n: [float(x) for x in t] for n, t in v.items()}
                                  for k, v in timings.items()}


def measure_split(workers: int, reps: int = 9, arena: int = 256 << 20
                  ) -> tuple[SplitLimits, dict[str, dict[str, list[float]]]]:
    """The limits from copies of each `SPLIT_CANDIDATES` size done by this thread alone and
    cut into ``workers`` pieces, the others on a pool's threads as `DirectSegments` does, of
    each of `KINDS`: writes into the next place of an ``arena`` of touched memory (cold in
    the caches, as a segment's), reads out of it into one reused buffer, and reads into a new
    anonymous mapping (``fresh``). Each limit is the least-cost cut
    (`streamcopy.least_cost_limit`): whole up to it, split above; the largest candidate
    there means never split (`NEVER`)."""
    big = np.ones(arena, np.uint8)
    one = np.ones(SPLIT_CANDIDATES[-1], np.uint8)
    took: dict[str, dict[int, tuple[list[float], list[float]]]] = {
        d: {n: ([], []) for n in SPLIT_CANDIDATES} for d in KINDS}
    with ThreadPoolExecutor(max(1, workers - 1)) as pool:
        at = 0
        for r in range(reps):
            for size in SPLIT_CANDIDATES:
                for kind in KINDS:
                    for split in (r % 2 == 0, r % 2 == 1):
                        at = at + size if at + 2 * size <= big.nbytes else 0
                        place = big[at:at + size]
                        new = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) \
                            if kind == "fresh" else None  # as a get's new buffer
                        mine = one[:size] if new is None else np.frombuffer(new, np.uint8)
                        dst, src = (place, mine) if kind == "write" else (mine, place)
                        t0 = time.perf_counter()
                        if split:
                            cuts = _cuts(size, workers)
                            futs = [pool.submit(streamcopy.copy, dst[a:b], src[a:b])
                                    for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
                            streamcopy.copy(dst[:cuts[1]], src[:cuts[1]])
                            for f in futs:
                                f.result()
                        else:
                            streamcopy.copy(dst, src)
                        took[kind][size][split].append(time.perf_counter() - t0)
                        if new is not None:
                            del dst, src, mine
                            with contextlib.suppress(BufferError):  # a worker's last view
                                new.close()
    timings = {d: {str(n): [round(statistics.median(t) * 1e6, 2) for t in v[n]]
                   for n in SPLIT_CANDIDATES} for d, v in took.items()}

    def limit(d: str) -> int:
        whole_up_to = streamcopy.least_cost_limit(timings[d])
        bigger = [n for n in SPLIT_CANDIDATES if n > whole_up_to]
        return bigger[0] if bigger else NEVER
    return SplitLimits(*(limit(k) for k in KINDS)), timings

LATE_READ = "read ended past its deadline: its read lease may have ended mid-copy"


class WriteExpired(TransferError):
    """A put's write expiry passed before its transfer could start: this client was late."""


class LeaseExpired(TransferError):
    """A get's read lease (less `lease_margin`) ended before its read could start: the client
    must ask for the replicas again, not read ranges that may hold another value by now."""


def transfer_timeout(cfg: ClientConfig, deadline: float | None, read: bool = False) -> float:
    """Seconds a transfer batch may take: ``transfer_timeout_s``, cut to a put's write
    ``deadline`` (or a get's read deadline with ``read``); `WriteExpired` (the put must be
    revoked) or `LeaseExpired` (the get must ask again) if that passed already."""
    timeout = cfg.transfer_timeout_s
    if deadline is not None:
        timeout = min(timeout, deadline - time.monotonic())
        if timeout <= 0 and read:
            raise LeaseExpired(f"the read lease ended {-timeout:.3f}s before the read could "
                               "start")
        if timeout <= 0:
            raise WriteExpired(f"the put's write expiry passed {-timeout:.3f}s before its "
                               "transfer could start")
    return timeout


class DirectSegments:
    """Maps of same-host node segments; `copy` performs the requests it can serve directly.

    The first request for a segment looks up its descriptor through the client's transfer engine
    (``describe``); a segment that cannot be looked up (its node is gone) fails its own requests
    only, so a put blames exactly that segment. A segment on another host, without a shared-memory
    file, or on an engine not allowed ``shm`` is remembered as "not direct" and goes through the
    engine. Otherwise the file is mapped once. The node's engine holds an exclusive ``flock`` on it
    while the segment is registered; before and after each batch of copies the client probes it
    with a shared lock: got one means the node died — the map is dropped, the requests go through
    the engine (which fails them), and a copy that raced the death ends FAILED, never DONE.
    Copies above `streamcopy.small_copy` bytes use `yuebing.transfer.streamcopy.copy`;
    batches and single reads of at least this machine's `split_limits` bytes use a few
    threads (the ``fresh`` limit where the destination is not faulted in yet). No write starts
    past the put's deadline and large ones check it between pieces (`copy_until`, TIMEOUT:
    revoked); a read ending past its lease's deadline ends TIMEOUT too (the client asks
    again)."""

    def __init__(self, engine: TransferEngine, enabled: bool = True,
                 wait: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled and "shm" in engine.config.transports
        self._maps: dict[str, MappedFile | None] = {}
        self._lock = threading.Lock()
        self.workers = default_workers()
        self._pool: ThreadPoolExecutor | None = None
        if self.enabled and self.workers >= 2:
            split_limits(self.workers, wait)  # ``wait``: until settled (`split_limits`)

    def _target(self, segment: str) -> MappedFile | str | None:
        """Where requests to ``segment`` go: its live mapping (copied here), None (the engine
        moves them), or why the segment cannot be looked up at all (they fail)."""
        try:
            self.engine.describe(segment)
        except TransferError as e:
            return str(e)
        if not self.enabled:
            return None
        mapped = self._map(segment)
        if mapped is not None and not mapped.owner_alive():
            log.warning("segment %s: no node holds it any more; unmapping", segment)
            self._forget(segment)
            mapped = None
        return mapped

    def _map(self, segment: str) -> MappedFile | None:
        """The segment's mapping: made on first use; None for segments the engine moves
        (remembered), and for now when its file cannot be mapped (tried again next time)."""
        with self._lock:
            if segment in self._maps:
                return self._maps[segment]
            try:
                d = self.engine.describe(segment)
                if not d.shm_path or d.host_id != self.engine.host_id:
                    self._maps[segment] = None
                    return None
                mapped = self._maps[segment] = MappedFile(d.shm_path, d.size)
                return mapped
            except (OSError, TransferError) as e:
                log.info("segment %s is not directly mappable now: %s", segment, e)
                return None

    def _forget(self, segment: str) -> None:
        with self._lock:
            mapped = self._maps.pop(segment, None)
        if mapped is not None:
            mapped.close()

    def copy(self, reqs: list[TransferRequest], deadline: float) -> list[RequestStatus | None]:
        """Copy every request whose segment is mapped here and whose node is alive, writes
        only until ``deadline`` (``time.monotonic()``); returns each one's status (DONE;
        TIMEOUT for a write the deadline cut or a read that ended past it — the lease behind a
        read's deadline may have ended mid-copy, so its bytes are not trusted; FAILED where
        the segment cannot be looked up, or its node was found dead after the copy), None for
        those left to the transfer engine.
        Requests were built by the store client: contiguous memoryviews, ``length`` set."""
        if len(reqs) == 1:  # a single get or put: no per-segment bookkeeping
            return [self._copy_one(reqs[0], deadline)]
        done: list[RequestStatus | None] = [None] * len(reqs)
        targets: dict[str, MappedFile | str | None] = {}
        jobs: list[tuple[OpCode, memoryview, MappedFile, int, int]] = []
        index: list[int] = []
        for i, r in enumerate(reqs):
            seg = str(r.segment)
            if seg in targets:
                target = targets[seg]
            else:
                target = targets[seg] = self._target(seg)
            n = r.length
            if isinstance(target, str):
                done[i] = RequestStatus(TransferStatus.FAILED, 0, n or 0, target)
            elif target is not None and n is not None and r.offset + n <= target.size:
                jobs.append((r.op, r.local, target, r.offset, n))  # type: ignore[arg-type]
                index.append(i)  # (out of range: the engine reports the error)
        results = self._run(jobs, deadline)
        late = time.monotonic() >= deadline
        gone = {seg: confirm(t, seg, [None])[0] for seg, t in targets.items()
                if isinstance(t, MappedFile)}
        for i, job, copied in zip(index, jobs, results, strict=True):
            done[i] = _judged(job[0], job[4], copied, gone[str(reqs[i].segment)], late)
        return done

    def _copy_one(self, r: TransferRequest, deadline: float) -> RequestStatus | None:
        """`copy` of one request."""
        seg = str(r.segment)
        target = self._target(seg)
        n = r.length
        if isinstance(target, str):
            return RequestStatus(TransferStatus.FAILED, 0, n or 0, target)
        if target is None or n is None or r.offset + n > target.size:
            return None
        job = (r.op, r.local, target, r.offset, n)
        copied = self._run([job], deadline)[0]  # type: ignore[list-item]
        late = time.monotonic() >= deadline
        return _judged(r.op, n, copied, confirm(target, seg, [None])[0], late)

    def _run(self, jobs: list[tuple[OpCode, memoryview, MappedFile, int, int]],
             deadline: float) -> list[int]:
        """Copy in this thread, or, for a batch or a single read of at least this machine's
        `split_limits` bytes (the read cut in pieces), split over `workers` threads
        (`streamcopy.copy` releases the GIL: copies overlap); returns the bytes each job
        copied. A destination not yet faulted in (its first job's middle page) takes the
        ``fresh`` limit."""
        one = len(jobs) == 1
        if not jobs or self.workers < 2 or (one and jobs[0][4] < SPLIT_CANDIDATES[0]):
            return _copy_all(jobs, deadline, alone=one)
        limits = split_limits(self.workers)
        op, local, mapped, off, n = jobs[0]
        if one and op == OpCode.WRITE:  # a single write is never cut (`copy_until` checks
            return _copy_all(jobs, deadline, alone=True)  # its deadline between pieces)
        total = n if one else sum(j[4] for j in jobs)
        warm_min = limits.read if one else limits.batch
        if total < min(warm_min, limits.fresh):
            return _copy_all(jobs, deadline, alone=one)
        mid = n // 2
        warm = resident(mapped.arr.ctypes.data + off + mid if op == OpCode.WRITE else
                        np.frombuffer(local, np.uint8, count=1, offset=mid).ctypes.data)
        if total < (warm_min if warm else limits.fresh):
            return _copy_all(jobs, deadline, alone=one)
        if one:  # a read copies all or is not trusted: its pieces are one job
            return [sum(self._parallel(_pieces(jobs[0], self.workers), deadline))]
        return self._parallel(jobs, deadline)

    def _parallel(self, jobs: list[tuple[OpCode, memoryview, MappedFile, int, int]],
                  deadline: float) -> list[int]:
        """``jobs`` split over `workers` threads (this one too), each at the write copy limit
        (an assignment would hold the GIL); the bytes each copied."""
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
        of the other requests, in order) elsewhere; the batch's is the worst of them (the
        engine's ``status`` itself when it had every request)."""
        if status is not None and len(status.requests) == len(results):
            return status
        if status is None and len(results) == 1 and results[0] is not None:
            return BatchStatus(BatchId(0), results[0].status, (results[0],))
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


def _judged(op: OpCode, n: int, copied: int, gone: str | None, late: bool) -> RequestStatus:
    """The status of a copy of ``n`` bytes that copied ``copied``: FAILED if its node was found
    dead after it (``gone``: why), TIMEOUT for a read ended ``late`` (past its lease's
    deadline) or a write the deadline cut, else DONE."""
    if gone is not None:  # its node died: nothing copied there counts
        return RequestStatus(TransferStatus.FAILED, 0, n, gone)
    if op == OpCode.READ and late:  # e.g. preempted mid-copy past the read lease
        return RequestStatus(TransferStatus.TIMEOUT, copied, n, LATE_READ)
    if copied == n:
        return RequestStatus(TransferStatus.DONE, n, n)
    return RequestStatus(TransferStatus.TIMEOUT, copied, n, expired_write(copied, n))


def _pieces(job: tuple[OpCode, memoryview, MappedFile, int, int],
            k: int) -> list[tuple[OpCode, memoryview, MappedFile, int, int]]:
    """``job`` as ``k`` jobs on consecutive ranges (cut at 4 KiB: whole pages and lines)."""
    op, local, mapped, off, n = job
    cuts = _cuts(n, k)
    return [(op, local[a:b], mapped, off + a, b - a)
            for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def _cuts(n: int, k: int) -> list[int]:
    """Where ``n`` bytes are cut into ``k`` consecutive pieces (at 4 KiB: whole pages and
    lines), from 0 to ``n``; pieces may be empty."""
    step = max(4096, n // k // 4096 * 4096)
    return [min(n, i * step) for i in range(k)] + [n]


def _copy_all(jobs: list[tuple[OpCode, memoryview, MappedFile, int, int]],
              deadline: float, alone: bool = False) -> list[int]:
    return [_copy(*job, deadline, alone) for job in jobs]


def _copy(op: OpCode, local: memoryview, mapped: MappedFile, off: int, n: int,
          deadline: float, alone: bool = False) -> int:
    """Copy one request; returns the bytes copied (a write stops at ``deadline``). The read
    limit (a warm destination) holds for a read ``alone``; a batch's reads take the write
    limit: their destinations are cold and an assignment holds the GIL (quiet A/B, same-host
    batch_get 1 MiB: 4.9 GB/s at the 2 MiB read limit, 7.1 at 256 KiB)."""
    if op == OpCode.WRITE and time.monotonic() >= deadline:
        return 0
    if n <= streamcopy.small_copy(op == OpCode.READ and alone):
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


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MAX_MMAP_THRESHOLD = 32 << 20
"""glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)."""

_kept = 0

_from_size: Any = None
try:
    _from_size = ctypes.pythonapi.PyByteArray_FromStringAndSize
    _from_size.restype = ctypes.py_object
    _from_size.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)
except AttributeError:  # not CPython
    _from_size = None


def new_buffer(n: int) -> bytearray:
    """A ``bytearray`` of ``n`` bytes whose contents are undefined (not zero-filled): for a
    caller that overwrites all of it. CPython's ``PyByteArray_FromStringAndSize(NULL, n)``;
    elsewhere a plain ``bytearray(n)``."""
    if n < 0:
        raise ValueError(f"buffer size must be >= 0, got {n}")
    if _from_size is None:
        return bytearray(n)
    out: bytearray = _from_size(None, n)
    return out


def keep_freed_memory(keep_bytes: int) -> bool:
    """Let glibc keep up to ``keep_bytes`` of freed heap (``M_TRIM_THRESHOLD``) and serve blocks
    up to 32 MiB from the heap (``M_MMAP_THRESHOLD``), process-wide, so buffers freed by one
    read are reused, already faulted in, by the next. ``0`` changes nothing. Returns whether
    the thresholds are in effect (False on other C libraries). Only ever raises the trim
    threshold: a second client asking for less keeps the larger one."""
    global _kept
    if keep_bytes <= 0:
        return False
    if keep_bytes <= _kept:
        return True
    try:
        ok = bool(_libc.mallopt(M_MMAP_THRESHOLD, min(keep_bytes, MAX_MMAP_THRESHOLD))) \
            and bool(_libc.mallopt(M_TRIM_THRESHOLD, keep_bytes))
    except AttributeError:  # no C library, or not glibc
        ok = False
    if ok:
        _kept = keep_bytes
    else:
        log.info("mallopt unavailable: freed value buffers go back to the OS")
    return ok
