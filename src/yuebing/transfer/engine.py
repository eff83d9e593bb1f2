"""`TransferEngine`: the public face of the transfer engine, one per process (or more).

The application registers memory (`register_segment`), published to the metadata service so
peers address it as (segment, offset, length), then `submit`s READ/WRITE `TransferRequest`s:
every request and remote range is checked *before* anything moves (a bad batch raises and
changes nothing); each is cut into slices for its peer's transport (own segments copied in
place, same-host shared memory into the peer's mapping, else TCP lanes) and handed to a pooled
endpoint (`Peers`). The caller polls `status`, blocks in `wait` or awaits `wait_async`, then
`free`s (or `transfer` / `transfer_status` do all three); a reaper thread times out batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from yuebing.core.errors import InputError, TransferError
from yuebing.protocol.transfer import Hello, HelloReply, Notify, SegmentDescriptor
from yuebing.transfer import streamcopy
from yuebing.transfer.batch import Batch, RequestState
from yuebing.transfer.config import TransferConfig
from yuebing.transfer.lanes import resolve_lanes
from yuebing.transfer.liveness import sweep_dead_segments
from yuebing.transfer.metadata import (
    DEFAULT_EMBEDDED,
    EtcdMetadata,
    MetadataService,
    P2PMetadata,
)
from yuebing.transfer.notify import NotifyInbox
from yuebing.transfer.peers import Peers
from yuebing.transfer.routing import Plan, frame_status, one_frame, route, timed_out
from yuebing.transfer.segment import (
    Segment,
    SegmentTable,
    check_range,
    create_shm_segment,
    validate_name,
    wrap_buffer_segment,
)
from yuebing.transfer.transport import shm as _shm  # noqa: F401 - registers shm, local
from yuebing.transfer.transport import tcp_client as _tcp  # noqa: F401 - registers tcp
from yuebing.transfer.transport.base import TRANSPORTS, LocalContext
from yuebing.transfer.transport.lane_ops import NotifyOp
from yuebing.transfer.transport.tcp_client import open_socket
from yuebing.transfer.transport.tcp_server import LandedFn, TcpServer
from yuebing.transfer.types import (
    BatchId,
    BatchStatus,
    Notification,
    TransferRequest,
)

log = logging.getLogger(__name__)

MAX_NOTIFY_BYTES = 1 << 20
NOTIFY_QUEUE = 65536


class TransferEngine:
    """Registered segments + batched READ/WRITE to any peer's segments. Thread-safe.

    Quick use::

        owner = TransferEngine(TransferConfig(metadata="embedded"))   # or p2p / etcd://h:p
        seg = owner.register_segment("node0/dram", size=64 << 20)     # shm-backed segment
        peer = TransferEngine()
        buf = bytearray(4096)
        bid = peer.submit([TransferRequest(OpCode.WRITE, b"x" * 4096, "node0/dram", 0),
                           TransferRequest(OpCode.READ, buf, "node0/dram", 8192)])
        peer.wait(bid).raise_for_status(); peer.free(bid)
        peer.transfer([...])              # submit + wait + free (one frame: in this thread)
        await peer.transfer_async([...])  # asyncio
        peer.notify("node0/dram", "topic", b"payload"); owner.next_notify(1.0)
    """

    def __init__(self, config: TransferConfig | None = None,
                 metadata: MetadataService | None = None) -> None:
        self.config, self.lanes_from = resolve_lanes(config or TransferConfig(), TransferEngine)
        cfg = self.config
        self.engine_id = cfg.engine_id or uuid.uuid4().hex[:12]
        self.host_id = cfg.host_id
        self._segments = SegmentTable()
        self._ctx = LocalContext(self.engine_id, self.host_id, cfg, self._segments)
        self._owns_metadata = metadata is None
        self.metadata = metadata or self._default_metadata()
        self._inbox = NotifyInbox(self.engine_id, NOTIFY_QUEUE)
        self._server = TcpServer(cfg, self._segments, self._hello, self._inbox.deliver)
        self.address = self._server.address
        self._peers = Peers(self._ctx, self.metadata,
                            [TRANSPORTS.get(n)(self._ctx) for n in ("local", *cfg.transports)])
        self._batches: dict[BatchId, Batch] = {}
        self._active: list[Batch] = []
        self._ids = itertools.count(1)
        self._cv = threading.Condition()
        self._wake_at = float("inf")
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="tx-reaper", daemon=True)
        self._reaper.start()
        sweep_dead_segments(cfg.shm_dir)
        small = streamcopy.small_copy() if "shm" in cfg.transports else 0  # settled now
        log.info("transfer engine %s listening on %s (transports %s, %d TCP lanes: %s, "
                 "streamed writes above %d bytes, reads above %d)", self.engine_id,
                 self.address, ",".join(cfg.transports), cfg.lanes, self.lanes_from, small,
                 streamcopy.small_copy(read=True) if small else 0)

    def _default_metadata(self) -> MetadataService:
        m = self.config.metadata
        if m == "embedded":
            return DEFAULT_EMBEDDED
        if m == "p2p":
            return P2PMetadata(self._handshake)
        return EtcdMetadata(m)

    # ---- segments -------------------------------------------------------------------------

    def register_segment(self, name: str, size: int | None = None, buffer: object = None,
                         prefault: bool = False) -> Segment:
        """Register memory under ``name`` and publish it. Give ``size`` for a new zero-filled
        shared-memory segment (reachable by same-host peers without sockets), or ``buffer``
        (numpy array, bytearray, torch CPU tensor...) to expose existing memory over TCP."""
        validate_name(name)
        if (size is None) == (buffer is None):
            raise InputError("register_segment needs exactly one of size= or buffer=")
        seg = (create_shm_segment(name, size, self.config.shm_dir, prefault) if size is not None
               else wrap_buffer_segment(name, buffer))
        try:
            self._segments.add(seg)
        except InputError:
            seg.close()
            raise
        try:
            self.metadata.publish(seg.descriptor(self.engine_id, self.host_id, self.address))
        except TransferError:
            self._segments.remove(name).close()
            raise
        return seg

    def unregister_segment(self, name: str) -> None:
        """Withdraw and release segment ``name``; later accesses to it are rejected."""
        seg = self._segments.remove(name)
        self._peers.forget(name)
        self.metadata.withdraw(name)
        seg.close()

    def segment(self, name: str) -> Segment:
        seg = self._segments.get(name)
        if seg is None:
            raise InputError(f"segment {name!r} is not registered on this engine")
        return seg

    def segment_name(self, name: str) -> str:
        """The name peers use for this engine's segment ``name`` (``host:port/name`` in p2p)."""
        return f"{self.address}/{name}" if isinstance(self.metadata, P2PMetadata) else name

    def _hello(self, hello: Hello) -> HelloReply:
        segs = [s.descriptor(self.engine_id, self.host_id, self.address)
                for s in self._segments.all()]
        return HelloReply(engine_id=self.engine_id, host_id=self.host_id, segments=segs)

    def _handshake(self, address: str) -> HelloReply:
        sock, reply = open_socket(address, self._ctx, self.config.connect_timeout_s)
        sock.close()
        return reply

    def describe(self, segment: str) -> SegmentDescriptor:
        """The descriptor of ``segment`` (cached after the first lookup, looked up again once
        it proves stale: `Peers`)."""
        return self._peers.describe(segment)

    # ---- batches --------------------------------------------------------------------------

    def submit(self, requests: Sequence[TransferRequest], timeout_s: float | None = None,
               inline: bool = False) -> BatchId:
        """Start a batch and return its id at once. Raises `InputError` / `TransferError` for
        malformed requests, unknown segments or out-of-range accesses — then nothing moves.
        ``inline``: a batch to one peer, of one direction and at most ``inline_bytes``, is
        moved in this thread before returning, within the batch deadline (TCP: no lane thread
        hand-offs; the batch is usually terminal when ``submit`` returns) — for blocking
        callers, not event loops. Batches to several peers go through the lanes in parallel."""
        self._check_open(requests)
        timeout = self._timeout(timeout_s)
        # per segment name: its endpoint, or why none (stale descriptors replaced)
        plan, eps = self._peers.connect(self._validate(requests))
        states: list[RequestState] = []
        for r, local, _ in plan:
            ep = eps[r.segment]
            n = local.nbytes
            size = n if isinstance(ep, str) else (ep.slice_size or n)
            states.append(RequestState(r.op, n, -(-n // size)))
        batch = Batch(BatchId(next(self._ids)), states, time.monotonic() + timeout)
        with self._cv:
            self._batches[batch.id] = batch
            if len(self._active) >= 1024:  # amortized pruning between reaper wake-ups
                self._active = [b for b in self._active if not b.event.is_set()]
            self._active.append(batch)
            if batch.deadline < self._wake_at:
                self._cv.notify()
        route(batch, plan, eps, self.config.inline_bytes if inline else 0)
        return batch.id

    def _check_open(self, requests: Sequence[TransferRequest]) -> None:
        """Refuse a batch on a closed engine or one without requests (`submit`,
        `transfer_status`)."""
        if self._closed:
            raise TransferError("transfer engine is closed")
        if not requests:
            raise InputError("a batch needs at least one request")

    def _timeout(self, timeout_s: float | None) -> float:
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        if not 0 < timeout < 1e9:  # a write frame carries its deadline: it must be a time
            raise InputError(f"timeout_s must be a finite number of seconds > 0, got {timeout}")
        return timeout

    def _validate(self, requests: Sequence[TransferRequest]) -> Plan:
        """Check every request and its remote range; raises before anything is sent."""
        plan = []
        for i, r in enumerate(requests):
            if type(r) is not TransferRequest:
                raise InputError(f"request {i} is a {type(r).__name__}, not a TransferRequest")
            local, length = r.resolve()
            desc = self._peers.cached(r.segment) or self._peers.describe(str(r.segment))
            check_range(r.segment, desc.size, r.offset, length)
            plan.append((r, local, desc))
        return plan

    def _batch(self, batch_id: BatchId) -> Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise InputError(f"unknown batch id {batch_id} (never submitted or already freed)")
        return batch

    def status(self, batch_id: BatchId) -> BatchStatus:
        """Poll: a snapshot of the batch and each request."""
        return self._batch(batch_id).snapshot()

    def wait(self, batch_id: BatchId, timeout_s: float | None = None) -> BatchStatus:
        """Block until the batch is terminal (or ``timeout_s`` passes) and return its status."""
        batch = self._batch(batch_id)
        batch.event.wait(timeout_s)
        return batch.snapshot()

    async def wait_async(self, batch_id: BatchId) -> BatchStatus:
        """Await the batch's terminal status without blocking the event loop."""
        batch = self._batch(batch_id)
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[BatchStatus] = loop.create_future()

        def resolve(snap: BatchStatus) -> None:
            if not fut.done():
                fut.set_result(snap)

        def done(b: Batch) -> None:
            loop.call_soon_threadsafe(resolve, b.snapshot())

        batch.add_callback(done)
        return await fut

    def free(self, batch_id: BatchId) -> None:
        """Forget a terminal batch; freeing one still in flight is an `InputError`."""
        batch = self._batch(batch_id)
        if not batch.event.is_set():
            raise InputError(f"batch {batch_id} is still in flight; wait for it before free")
        self._batches.pop(batch_id, None)

    def transfer(self, requests: Sequence[TransferRequest],
                 timeout_s: float | None = None, inline: bool = True) -> BatchStatus:
        """`transfer_status`, raising `TransferError` unless every request is DONE. A blocking
        call, so by default (``inline``) a batch of one frame's worth moves in the calling
        thread, as with `transfer_status`: no lane hand-off for a batch of one."""
        status = self.transfer_status(requests, timeout_s, inline)
        status.raise_for_status()
        return status

    def transfer_status(self, requests: Sequence[TransferRequest],
                        timeout_s: float | None = None, inline: bool = True) -> BatchStatus:
        """Move ``requests`` and return their terminal status — ``submit`` + ``wait`` + ``free``
        for blocking callers (the store client's puts and gets). With ``inline``, requests the
        peer's inline connection can take as one frame (one TCP peer and segment, one
        direction, at most ``inline_bytes``) move in this thread without batch bookkeeping
        (`Endpoint.exchange_frame`); anything else, or a frame whose connection breaks, goes
        the `submit` way within what is left of the same deadline."""
        return self._transfer(requests, timeout_s, inline, b"")[0]

    def transfer_noted(self, requests: Sequence[TransferRequest], note: bytes,
                       timeout_s: float | None = None) -> tuple[BatchStatus, bool]:
        """`transfer_status` of writes whose frame carries ``note`` to the target engine's
        landing callback (`on_landed`): (status, True) when they went as one inline TCP frame,
        which carried the note — a frame whose connection broke is then never sent again (it
        may have landed, note and all): its requests fail "may have landed" and the caller
        resolves that; (status, False) when they went the `submit` way, without the note (no
        byte of them had left)."""
        return self._transfer(requests, timeout_s, True, note)

    def _transfer(self, requests: Sequence[TransferRequest], timeout_s: float | None,
                  inline: bool, note: bytes) -> tuple[BatchStatus, bool]:
        self._check_open(requests)
        timeout = self._timeout(timeout_s)
        if inline:
            start = time.monotonic()
            plan = self._validate(requests)
            errors = one_frame(plan, start + timeout, self._peers.endpoint,
                               self.config.inline_bytes, note)
            if errors is not None:
                return frame_status(BatchId(next(self._ids)), plan, errors), True
            timeout -= time.monotonic() - start
            if timeout <= 0:
                return timed_out(BatchId(next(self._ids)), plan), False
        bid = self.submit(requests, timeout, inline)
        status = self.wait(bid)
        self.free(bid)
        return status, False

    async def transfer_async(self, requests: Sequence[TransferRequest],
                             timeout_s: float | None = None) -> BatchStatus:
        bid = self.submit(requests, timeout_s)
        status = await self.wait_async(bid)
        self.free(bid)
        status.raise_for_status()
        return status

    def _reap(self) -> None:
        """Reaper thread: time out batches whose deadline passed. It sleeps until the earliest
        deadline (``_wake_at``); `submit` wakes it only for an earlier one."""
        with self._cv:
            while not self._closed:
                now = time.monotonic()
                self._active = [b for b in self._active if not b.event.is_set()]
                for b in [b for b in self._active if b.deadline <= now]:
                    b.expire(now)
                pending = [b.deadline for b in self._active if not b.event.is_set()]
                self._wake_at = min(pending) if pending else float("inf")
                self._cv.wait(max(self._wake_at - now, 0.001) if pending else None)

    # ---- notifications --------------------------------------------------------------------

    def notify(self, segment: str, topic: str, payload: bytes = b"",
               timeout_s: float | None = None) -> None:
        """Deliver a small message to the engine owning ``segment``; returns once it has been
        handed to the peer's notify callback or queue. Raises `TransferError` otherwise."""
        if len(payload) > MAX_NOTIFY_BYTES:
            raise InputError(f"notify payload of {len(payload)} bytes exceeds {MAX_NOTIFY_BYTES}")
        desc = self.describe(segment)
        if desc.engine_id == self.engine_id:
            self._inbox.deliver(Notify(id=0, sender=self.engine_id, topic=topic,
                                       payload=bytes(payload)))
            return
        ep = self._peers.notify_endpoint(segment, desc)
        op = NotifyOp(self.engine_id, topic, bytes(payload))
        ep.notify(op)
        timeout = self.config.timeout_s if timeout_s is None else timeout_s
        if not op.event.wait(timeout):
            raise TransferError(f"notify to {desc.engine_id} not acknowledged within {timeout}s")
        if op.error:
            raise TransferError(f"notify to {desc.engine_id} failed: {op.error}")

    def on_notify(self, callback: Callable[[Notification], None]) -> None:
        """Call ``callback(notification)`` (from a lane thread) for each arriving notify,
        instead of queueing it for `next_notify`."""
        self._inbox.subscribe(callback)

    def on_landed(self, callback: LandedFn | None) -> None:
        """Call ``callback(segment, slices, note)`` (from a lane thread, before the frame is
        answered) for each write frame into this engine's segments that carries a note
        (`transfer_noted`) and landed whole: every slice accepted within the frame's write
        expiry and received. None turns it off."""
        self._server.on_landed = callback

    def next_notify(self, timeout_s: float | None = None) -> Notification | None:
        """The oldest queued notification, waiting up to ``timeout_s``; None if none came."""
        return self._inbox.get(timeout_s)

    # ---- life cycle -----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        pool = self._peers.pool
        return {"endpoints": len(pool), "evictions": pool.evictions, "lanes": self.config.lanes,
                "batches": len(self._batches), "served_slices": self._server.served_slices,
                "segments": len(self._segments.names())}

    def close(self) -> None:
        """Fail batches in flight, close endpoints, stop serving, withdraw and free segments."""
        if self._closed:
            return
        with self._cv:
            self._closed = True
            active, self._active = self._active, []
            self._cv.notify()
        for b in active:
            b.fail_all("transfer engine closed")
        for _, ep in self._peers.pool.drain():
            ep.close()
        self._server.close()
        for seg in self._segments.all():
            with contextlib.suppress(TransferError, InputError):
                self.unregister_segment(seg.name)
        if self._owns_metadata and self.metadata is not DEFAULT_EMBEDDED:
            self.metadata.close()
        self._reaper.join(timeout=2)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
