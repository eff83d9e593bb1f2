"""Value types of the transfer engine's public API: operations, the ordered status machine,
requests and the status snapshots returned by poll/wait.

A request's status only moves forward: PENDING (accepted, nothing sent) → TRANSFERRING (at least
one slice handed to a transport) → DONE, or → FAILED / TIMEOUT. DONE, FAILED and TIMEOUT are
terminal; `TransferStatus.terminal` tells them apart from the in-flight states.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple, NewType

from yuebing.core.errors import InputError, TransferError
from yuebing.core.ids import SegmentName

BatchId = NewType("BatchId", int)
"""Handle of a submitted batch, unique within one engine."""


class OpCode(IntEnum):
    """READ copies remote segment bytes into the local buffer; WRITE copies local → remote."""

    READ = 0
    WRITE = 1


class TransferStatus(IntEnum):
    """Ordered state of a request or batch: pending < transferring < done; failed/timeout."""

    PENDING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3
    TIMEOUT = 4

    @property
    def terminal(self) -> bool:
        return self >= TransferStatus.DONE


def as_buffer(buf: object, *, writable: bool) -> memoryview:
    """A flat byte view of ``buf`` (bytes, bytearray, numpy array, torch CPU tensor via numpy,
    mmap, memoryview); raises `InputError` if it is not contiguous or, for reads, read-only."""
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        numpy = getattr(buf, "numpy", None)  # torch CPU tensor → numpy view (no copy)
        if not callable(numpy):
            raise InputError(f"local buffer of type {type(buf).__name__} is not a buffer") from None
        try:
            mv = memoryview(numpy())
        except (TypeError, RuntimeError) as e:
            raise InputError(f"local buffer of type {type(buf).__name__} has no CPU bytes: {e}"
                             ) from None
    if not mv.c_contiguous:
        raise InputError("local buffer must be C-contiguous")
    if writable and mv.readonly:
        raise InputError("READ needs a writable local buffer (got a read-only one)")
    return mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv


def _index(value: object) -> int | None:
    """``value`` as an int if it is an integer other than a bool — an int subclass, or a numpy
    integer scalar (KV offsets are often computed with numpy) —, else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def as_int(value: object, what: str, low: int = 0) -> int:
    """``value`` as a Python int (ints and integral numpy scalars such as ``np.int64``), or
    `InputError` naming ``what`` when it is not an integer or is below ``low`` (0 or 1)."""
    n = value if type(value) is int else _index(value)
    if n is None or n < low:
        raise InputError(f"{what} must be a {_kind(low)} int, got {value!r}")
    return n


def _kind(low: int) -> str:
    return "non-negative" if low == 0 else "positive" if low == 1 else f">= {low}"


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """One copy between a local buffer and ``length`` bytes at ``offset`` of remote ``segment``.

    ``local`` is any contiguous buffer (writable for READ); ``length`` defaults to its size.
    Only the first ``length`` bytes of ``local`` are used. ``offset`` and ``length`` may be
    integral numpy scalars (``np.int64``...): they are stored as ints.
    """

    op: OpCode
    local: object
    segment: SegmentName | str
    offset: int
    length: int | None = None

    def __post_init__(self) -> None:
        # anything not integral is kept as given, for `resolve` to refuse precisely
        if type(self.offset) is not int:
            n = _index(self.offset)
            if n is not None:
                object.__setattr__(self, "offset", n)
        if self.length is not None and type(self.length) is not int:
            n = _index(self.length)
            if n is not None:
                object.__setattr__(self, "length", n)

    def resolve(self) -> tuple[memoryview, int]:
        """(flat local view of exactly ``length`` bytes, length); raises `InputError`."""
        op = self.op
        if op is not OpCode.WRITE and op is not OpCode.READ:
            raise InputError(f"op must be OpCode.READ or OpCode.WRITE, got {op!r}")
        mv = as_buffer(self.local, writable=op is OpCode.READ)
        length = mv.nbytes if self.length is None else self.length
        if type(length) is not int or length <= 0:
            raise InputError(f"length must be a positive int, got {length!r}")
        if length > mv.nbytes:
            raise InputError(f"length {length} exceeds the local buffer ({mv.nbytes} bytes)")
        if type(self.offset) is not int or self.offset < 0:
            raise InputError(f"remote offset must be a non-negative int, got {self.offset!r}")
        if not isinstance(self.segment, str) or not self.segment:
            raise InputError(f"segment must be a non-empty name, got {self.segment!r}")
        return (mv if length == mv.nbytes else mv[:length]), length


class RequestStatus(NamedTuple):
    """Snapshot of one request: status, bytes confirmed so far, and the error if it failed."""

    status: TransferStatus
    transferred: int
    length: int
    error: str = ""


@dataclass(frozen=True, slots=True)
class BatchStatus:
    """Snapshot of a batch. ``status`` is DONE when all requests are; TIMEOUT if any timed out,
    else FAILED if any failed (reported once every request is terminal); otherwise the least
    advanced in-flight state."""

    batch_id: BatchId
    status: TransferStatus
    requests: tuple[RequestStatus, ...]

    @property
    def errors(self) -> list[str]:
        return [f"request {i}: {r.error}" for i, r in enumerate(self.requests) if r.error]

    def raise_for_status(self) -> None:
        """Raise `TransferError` naming every failed request unless the batch is DONE."""
        if self.status != TransferStatus.DONE:
            detail = "; ".join(self.errors) or "not finished"
            raise TransferError(f"batch {self.batch_id} {self.status.name}: {detail}")


@dataclass(frozen=True, slots=True)
class Notification:
    """A small message from a peer engine (``sender`` is its engine id)."""

    sender: str
    topic: str
    payload: bytes
