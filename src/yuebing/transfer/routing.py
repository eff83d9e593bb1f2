"""Where a validated batch's requests go: `route` cuts them into slices and hands each
segment's to its endpoint (inline in the submitting thread when the batch allows it, else the
endpoint's lanes); `one_frame` moves a whole batch as one inline frame of whole requests
(`Endpoint.exchange_frame`) when it is one frame's worth, and `frame_status` / `timed_out` turn
what came of it into a `BatchStatus`.

Called by `TransferEngine.submit` (`route`) and `TransferEngine.transfer_status` (the others)
with the engine's plan: (request, its flat local view, its segment's descriptor) per request,
every range already checked.
"""

from __future__ import annotations

from collections.abc import Callable

from yuebing.core.errors import TransferError
from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer.batch import Batch, Slice
from yuebing.transfer.transport.base import Endpoint
from yuebing.transfer.types import (
    BatchId,
    BatchStatus,
    RequestStatus,
    TransferRequest,
    TransferStatus,
)

Plan = list[tuple[TransferRequest, memoryview, SegmentDescriptor]]


def route(batch: Batch, plan: Plan, eps: dict[str, Endpoint | str], inline_limit: int) -> None:
    """Cut the requests into slices and hand them to their endpoints, one call per segment;
    requests without an endpoint (``eps`` holds why) fail with the connection error. With
    ``inline_limit`` > 0 a batch to one segment of at most that many bytes, one direction,
    moves in this thread if the endpoint can (`Endpoint.submit_inline`)."""
    groups: dict[str, tuple[SegmentDescriptor, list[Slice]]] = {}
    for i, (r, local, desc) in enumerate(plan):
        ep = eps[r.segment]
        if isinstance(ep, str):
            batch.slice_done(i, 0, ep)
            continue
        group = groups.get(r.segment)
        if group is None:
            group = groups[r.segment] = (desc, [])
        out = group[1]
        n, size, name, off = local.nbytes, ep.slice_size, desc.name, r.offset
        span = (off, n)
        if not size or n <= size:
            out.append(Slice(batch, i, r.op, local, name, off, span))
        else:
            out += [Slice(batch, i, r.op, local[a:a + size], name, off + a, span)
                    for a in range(0, n, size)]
    # inline only when the batch has one peer: groups run one after another in this thread,
    # so with several peers a stalled one would hold up the others (the lanes run them at once)
    limit = inline_limit if len(groups) == 1 else 0
    for segment, (desc, slices) in groups.items():
        ep = eps[segment]
        assert not isinstance(ep, str)
        if limit and sum(s.length for s in slices) <= limit and all(
                s.op == slices[0].op for s in slices) and ep.submit_inline(desc, slices):
            continue
        ep.submit(desc, slices)


def one_frame(plan: Plan, deadline: float, endpoint: Callable[[SegmentDescriptor], Endpoint],
              inline_bytes: int, note: bytes = b"") -> list[str] | None:
    """Each request's error ("" = done) after moving ``plan`` as one inline frame by
    ``deadline`` (a write carrying ``note``); None when it is not one frame's worth (one
    segment, one direction, at most ``inline_bytes``) or the endpoint could not — then nothing
    of it is known to have moved (nor the note; a noted frame that may have left fails
    instead: `TcpEndpoint.exchange_frame`)."""
    r0, _, desc = plan[0]
    op, segment = r0.op, r0.segment
    total = 0
    for r, local, _ in plan:
        if r.op is not op or r.segment != segment:
            return None
        total += local.nbytes
    if total > inline_bytes:
        return None
    try:
        ep = endpoint(desc)
    except TransferError:
        return None  # submit fails the requests with the reason
    return ep.exchange_frame(desc.name, op, [(local, r.offset) for r, local, _ in plan], deadline,
                             note)


def frame_status(batch_id: BatchId, plan: Plan, errors: list[str]) -> BatchStatus:
    """The terminal status of a batch `one_frame` moved (``errors`` per request)."""
    return BatchStatus(
        batch_id, TransferStatus.FAILED if any(errors) else TransferStatus.DONE,
        tuple(RequestStatus(TransferStatus.FAILED, 0, local.nbytes, e) if e
              else RequestStatus(TransferStatus.DONE, local.nbytes, local.nbytes, "")
              for (_, local, _), e in zip(plan, errors, strict=True)))


def timed_out(batch_id: BatchId, plan: Plan) -> BatchStatus:
    """Every request TIMEOUT: the deadline passed before the batch could be moved."""
    return BatchStatus(batch_id, TransferStatus.TIMEOUT, tuple(
        RequestStatus(TransferStatus.TIMEOUT, 0, local.nbytes,
                      "deadline passed before the batch could be moved") for _, local, _ in plan))
