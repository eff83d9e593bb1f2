"""yuebing.transfer — batched zero-copy transfers between registered memory of processes.

`TransferEngine` (quick use in its docstring) registers segments and moves batches of READ /
WRITE `TransferRequest`s to any peer's segments, for the store, the instances and the vLLM
hand-off. Status per request and batch is the ordered `TransferStatus` (PENDING <
TRANSFERRING < DONE; FAILED, TIMEOUT). Transports: ``local`` (own segments), ``shm`` (same
host), ``tcp`` (lanes); new ones implement `Transport` / `Endpoint` and register in
`TRANSPORTS`. `sweep_dead_segments(shm_dir)` unlinks the shared-memory segment files of dead
engines (a supervisor calls it when a child dies; it never removes a live owner's file).
"""

from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.engine import TransferEngine
from yuebing.transfer.liveness import sweep_dead_segments
from yuebing.transfer.metadata import (
    EmbeddedMetadata,
    EtcdMetadata,
    MetadataService,
    P2PMetadata,
)
from yuebing.transfer.segment import Segment
from yuebing.transfer.transport.base import TRANSPORTS, Endpoint, Transport
from yuebing.transfer.types import (
    BatchId,
    BatchStatus,
    Notification,
    OpCode,
    RequestStatus,
    TransferRequest,
    TransferStatus,
)

__all__ = [
    "TRANSPORTS",
    "BatchId",
    "BatchStatus",
    "EmbeddedMetadata",
    "Endpoint",
    "EtcdMetadata",
    "MetadataService",
    "Notification",
    "OpCode",
    "P2PMetadata",
    "RequestStatus",
    "Segment",
    "SegmentDescriptor",
    "Transport",
    "TransferConfig",
    "TransferEngine",
    "TransferRequest",
    "TransferStatus",
    "sweep_dead_segments",
]
