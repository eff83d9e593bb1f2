"""Batch bookkeeping: requests cut into slices, per-request and per-batch status, completion.

Life cycle: `TransferEngine.submit` validates the requests, builds a `Batch` of `RequestState`s
and cuts each request into `Slice`s (`split_ranges`); transports complete slices from their own
threads with `Slice.complete`. A request becomes TRANSFERRING when its first slice is handed to a
transport, DONE when its last slice is acknowledged, FAILED on the first slice that fails for
good (after the transport's retries), TIMEOUT when the batch deadline passes first (`expire`,
called by the engine's reaper thread). When every request is terminal the batch's event is set
and its callbacks (asyncio waiters) run. Status never moves backwards.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from yuebing.transfer.types import BatchId, BatchStatus, OpCode, RequestStatus, TransferStatus

# Plain-int copies of the states: the hot path compares ints, snapshots hand out the enum.
_PENDING, _TRANSFERRING, _DONE = int(TransferStatus.PENDING), int(TransferStatus.TRANSFERRING), int(TransferStatus.DONE)
_FAILED = int(TransferStatus.FAILED)


def split_ranges(length: int, slice_size: int) -> list[tuple[int, int]]:
    """Cut ``length`` bytes into (start, size) pieces of at most ``slice_size``, in order; the
    last piece carries the remainder. ``split_ranges(10, 4) == [(0, 4), (4, 4), (8, 2)]``."""
    if length <= 0 or slice_size <= 0:
        raise ValueError(f"length and slice_size must be positive, got {length}, {slice_size}")
    if length <= slice_size:
        return [(0, length)]
    return [(start, min(slice_size, length - start)) for start in range(0, length, slice_size)]


class RequestState:
    """Mutable state of one request; mutated only under its batch's lock."""

    __slots__ = ("length", "op", "status", "done_bytes", "slices_left", "error")

    status: int
    """A `TransferStatus` value as a plain int (cheap to compare on the hot path)."""

    def __init__(self, op: OpCode, length: int, n_slices: int) -> None:
        self.op = op
        self.length = length
        self.status = _PENDING
        self.done_bytes = 0
        self.slices_left = n_slices
        self.error = ""


class Slice:
    """A piece of a request: ``length`` bytes between ``local`` and ``offset`` of ``segment``."""

    __slots__ = ("batch", "index", "op", "local", "segment", "offset", "length", "attempts",
                 "span")

    def __init__(self, batch: Batch, index: int, op: OpCode, local: memoryview, segment: str,
                 offset: int, span: tuple[int, int] | None = None) -> None:
        self.batch = batch
        self.index = index
        self.op = op
        self.local = local
        self.segment = segment
        self.offset = offset
        self.length = local.nbytes
        self.attempts = 0
        self.span = span or (offset, self.length)
        """The whole request's remote (offset, length), checked by the owner for every slice."""

    @property
    def live(self) -> bool:
        """False once the request is terminal (failed, timed out): do not touch ``local``."""
        return self.batch.requests[self.index].status < _DONE

    @property
    def deadline(self) -> float:
        return self.batch.deadline

    def complete(self, error: str | None = None) -> None:
        """Called once by the transport when the slice is applied (``error`` None) or failed."""
        self.batch.slice_done(self.index, self.length, error)


def complete_slices(slices: Iterable[Slice], errors: Iterable[str | None]) -> None:
    """Complete many slices (``errors[i]`` None = applied) with one lock per batch involved."""
    by_batch: dict[int, tuple[Batch, list[tuple[int, int, str | None]]]] = {}
    for s, error in zip(slices, errors, strict=True):
        entry = by_batch.get(id(s.batch))
        if entry is None:
            entry = by_batch[id(s.batch)] = (s.batch, [])
        entry[1].append((s.index, s.length, error))
    for batch, results in by_batch.values():
        batch.slices_done(results)


class Batch:
    """A submitted batch. Thread-safe; see the module docstring for the state rules."""

    def __init__(self, batch_id: BatchId, requests: list[RequestState], deadline: float) -> None:
        self.id = batch_id
        self.requests = requests
        self.deadline = deadline
        self.event = threading.Event()
        self._lock = threading.Lock()
        self._open = sum(1 for r in requests if r.status < _DONE)
        self._callbacks: list[Callable[[Batch], None]] = []
        if self._open == 0:
            self.event.set()

    def started(self, index: int) -> None:
        self.started_many((index,))

    def started_many(self, indices: Iterable[int]) -> None:
        """Requests ``indices`` have slices in a transport's hands: PENDING → TRANSFERRING."""
        with self._lock:
            for index in indices:
                r = self.requests[index]
                if r.status == _PENDING:
                    r.status = _TRANSFERRING

    def slice_done(self, index: int, nbytes: int, error: str | None) -> None:
        self.slices_done(((index, nbytes, error),))

    def slices_done(self, results: Iterable[tuple[int, int, str | None]]) -> None:
        """Apply (request index, bytes, error or None) for many slices under one lock — how a
        transport completes a whole frame or copy run at once."""
        finish = False
        with self._lock:
            requests = self.requests
            for index, nbytes, error in results:
                r = requests[index]
                if r.status >= _DONE:
                    continue
                if error is not None:
                    r.status, r.error = _FAILED, error
                else:
                    r.done_bytes += nbytes
                    r.slices_left -= 1
                    if r.slices_left > 0:
                        r.status = _TRANSFERRING
                        continue
                    r.status = _DONE
                finish = self._closed_one() or finish
        if finish:
            self._finish()

    def fail_all(self, error: str, status: TransferStatus = TransferStatus.FAILED) -> None:
        """Mark every non-terminal request ``status`` (FAILED or TIMEOUT) with ``error``."""
        with self._lock:
            finish = False
            for r in self.requests:
                if r.status < _DONE:
                    r.status, r.error = int(status), error
                    finish = self._closed_one() or finish
        if finish:
            self._finish()

    def expire(self, now: float) -> bool:
        """Time the batch out if its deadline passed; True if that happened now."""
        if now < self.deadline or self.event.is_set():
            return False
        self.fail_all(f"deadline passed ({now - self.deadline:.3f}s late) before completion",
                      TransferStatus.TIMEOUT)
        return True

    def _closed_one(self) -> bool:
        self._open -= 1
        return self._open == 0

    def _finish(self) -> None:
        self.event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            cb(self)

    def add_callback(self, cb: Callable[[Batch], None]) -> None:
        """Run ``cb(batch)`` once the batch is terminal (at once if it already is)."""
        with self._lock:
            if not self.event.is_set():
                self._callbacks.append(cb)
                return
        cb(self)

    def snapshot(self) -> BatchStatus:
        with self._lock:
            codes = [r.status for r in self.requests]
            reqs = tuple(RequestStatus(_STATES[r.status], r.done_bytes, r.length, r.error)
                         for r in self.requests)
        return BatchStatus(self.id, _batch_status(codes), reqs)


_STATES = tuple(TransferStatus)
_TIMEOUT = int(TransferStatus.TIMEOUT)


def _batch_status(codes: list[int]) -> TransferStatus:
    """DONE if all are; TIMEOUT if any timed out, else FAILED if any failed (once all are
    terminal); otherwise the least advanced in-flight state."""
    in_flight = [c for c in codes if c < _DONE]
    if in_flight:
        return _STATES[min(in_flight)]
    if _TIMEOUT in codes:
        return TransferStatus.TIMEOUT
    if _FAILED in codes:
        return TransferStatus.FAILED
    return TransferStatus.DONE
