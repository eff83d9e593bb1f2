"""The transport seam: `Transport` (a way to reach peers) and `Endpoint` (an open path to one
peer). New transports (RDMA, UCX) implement these two classes and register in `TRANSPORTS`;
callers of `TransferEngine` never see them.

Who calls what: the engine (in the thread calling `TransferEngine.submit`) asks each configured
transport, in preference order, `can_reach(descriptor)`; the first that can is asked
`connect(descriptor)` — lazily, on the first request to that peer — and the endpoint is kept in
the engine's SIEVE-capped pool. `Endpoint.submit` must not block on the transfer; the endpoint
completes every slice exactly once with `Slice.complete` from its own threads, retrying failed
slices itself. The pool calls `close` on eviction or engine shutdown.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from yuebing.core.registry import Registry
from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer.batch import Slice
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.segment import SegmentTable
from yuebing.transfer.types import OpCode


@dataclass(frozen=True)
class LocalContext:
    """What a transport knows about the engine that owns it."""

    engine_id: str
    host_id: str
    config: TransferConfig
    segments: SegmentTable


class Endpoint(ABC):
    """An open path to one peer engine."""

    slice_size: int | None = None
    """Slice length the engine should cut requests into for this endpoint (None: whole)."""

    @abstractmethod
    def submit(self, desc: SegmentDescriptor, slices: list[Slice]) -> None:
        """Start moving ``slices`` of segment ``desc``; returns at once. Called by the engine in
        the submitting thread; every slice is later completed exactly once."""

    def submit_inline(self, desc: SegmentDescriptor, slices: list[Slice]) -> bool:
        """Move ``slices`` (all one direction) in the calling thread and complete them before
        returning (True), or do nothing and return False — then the engine calls `submit`.
        Called by the engine in the submitting thread for batches submitted with
        ``inline=True`` whose part for this peer is at most ``inline_bytes``. This default
        never moves anything inline."""
        return False

    def exchange_frame(self, segment: str, op: OpCode, items: list[tuple[memoryview, int]],
                       deadline: float, note: bytes = b"") -> list[str] | None:
        """Move whole requests — ``items`` of (local view, remote offset) in ``segment``, all
        ``op`` — in the calling thread without batch bookkeeping, a write with ``note`` for the
        target's landing callback (`WriteSlices.note`); returns each one's error (""
        when done), or None when this endpoint cannot (then nothing is known of the items and
        the engine moves them the `submit` way; never for a noted frame that may have left:
        that one fails instead, "may have landed"). Called by `TransferEngine.transfer_status`.
        This default never can."""
        return None

    def stale(self, desc: SegmentDescriptor) -> str:
        """Why ``desc`` is known not to describe the peer's live segment any more ("" when
        it is not known to be stale): the engine then drops its cached descriptor and looks
        the segment up again. Called by the engine in the submitting thread before each batch
        to this peer; must be cheap. This default knows nothing (the TCP target checks every
        access itself)."""
        return ""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once the peer is known dead or the endpoint closed; the engine then drops it."""

    @property
    @abstractmethod
    def busy(self) -> bool:
        """True while slices are in flight (the pool will not evict a busy endpoint)."""

    @abstractmethod
    def close(self) -> None:
        """Release connections/mappings; slices still in flight fail with an error."""


class Transport(ABC):
    """A way of reaching peers; one instance per engine, built with the engine's context."""

    name: str = ""

    def __init__(self, ctx: LocalContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def can_reach(self, desc: SegmentDescriptor) -> bool:
        """Whether this transport can serve segment ``desc`` from this engine."""

    @abstractmethod
    def connect(self, desc: SegmentDescriptor) -> Endpoint:
        """Open an endpoint to ``desc``'s owner; raises `TransferError` if unreachable."""


TRANSPORTS: Registry[type[Transport]] = Registry("transport")
