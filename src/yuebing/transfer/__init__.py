"""yuebing.transfer — batched zero-copy transfers between registered memory of processes.

Quick use (see `TransferEngine` for the life cycle of a batch)::

    from yuebing.transfer import OpCode, TransferConfig, TransferEngine, TransferRequest

    owner = TransferEngine(TransferConfig(metadata="embedded"))      # or p2p / etcd://h:p
    seg = owner.register_segment("node0/dram", size=64 << 20)        # shm-backed segment
    peer = TransferEngine()
    buf = bytearray(4096)
    bid = peer.submit([TransferRequest(OpCode.WRITE, b"x" * 4096, "node0/dram", 0),
                       TransferRequest(OpCode.READ, buf, "node0/dram", 8192)])
    peer.wait(bid).raise_for_status(); peer.free(bid)
    peer.transfer([...])                # submit + wait + free (one frame: in this thread), raises
    await peer.transfer_async([...])    # asyncio
    peer.notify("node0/dram", "topic", b"payload"); owner.next_notify(1.0)

Status per request and batch is the ordered `TransferStatus` (PENDING < TRANSFERRING < DONE;
FAILED, TIMEOUT). Transports: ``local`` (own segments), ``shm`` (same host), ``tcp`` (lanes);
new ones implement `Transport`/`Endpoint` and register in `TRANSPORTS`.
`sweep_dead_segments(shm_dir)` unlinks the shared-memory segment files of dead engines (a
supervisor calls it when a child dies; it never removes a live owner's file).
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
