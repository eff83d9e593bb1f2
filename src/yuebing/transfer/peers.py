"""`Peers`: how a `TransferEngine` reaches the segments its requests name — a cache of segment
descriptors from the metadata service and a SIEVE-capped pool of endpoints (lazily opened).

The engine calls it from the submitting thread: `describe` while validating a batch, `connect`
once per batch, `notify_endpoint` for notifications, `forget` when it unregisters a segment. A
cached descriptor goes stale when its owner dies or re-registers the name; it is dropped and
looked up again as soon as that shows (no endpoint opens, the pooled one is dead, or
`Endpoint.stale`). A fresh descriptor that differs takes this very batch; otherwise the
segment's requests fail with the reason, and the next batch looks it up again.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from yuebing.core.errors import TransferError
from yuebing.protocol.transfer import SegmentDescriptor
from yuebing.transfer.metadata import MetadataService
from yuebing.transfer.pool import SieveCache
from yuebing.transfer.routing import Plan
from yuebing.transfer.segment import check_range
from yuebing.transfer.transport.base import Endpoint, LocalContext, Transport
from yuebing.transfer.transport.tcp_client import PeerUnreachable, TcpEndpoint

log = logging.getLogger(__name__)


class Peers:
    """Descriptor cache + endpoint pool of one engine. Thread-safe (dict operations are
    atomic; the pool has its own lock)."""

    def __init__(self, ctx: LocalContext, metadata: MetadataService,
                 transports: list[Transport]) -> None:
        self.ctx = ctx
        self.metadata = metadata
        self.transports = transports
        self.pool: SieveCache[tuple[str, str, str], Endpoint] = SieveCache(
            ctx.config.max_endpoints, on_evict=lambda k, ep: ep.close(),
            evictable=lambda ep: not ep.busy)
        self._descs: dict[str, SegmentDescriptor] = {}

    def describe(self, name: str) -> SegmentDescriptor:
        """The descriptor of segment ``name`` (cached after the first lookup); `TransferError`
        when no engine publishes it (or, in p2p, its owner cannot be asked)."""
        desc = self._descs.get(name)
        if desc is None:
            desc = self.metadata.lookup(name)
            if desc is None:
                raise TransferError(f"segment {name!r} is not registered by any engine")
            self._descs[name] = desc
        return desc

    def cached(self, name: str) -> SegmentDescriptor | None:
        return self._descs.get(name)

    def forget(self, name: str) -> None:
        """Drop the cached descriptor of ``name``."""
        self._descs.pop(name, None)

    def _forget_engine(self, engine_id: str) -> None:
        for name in [n for n, d in self._descs.items() if d.engine_id == engine_id]:
            self._descs.pop(name, None)

    def endpoint(self, desc: SegmentDescriptor) -> Endpoint:
        """The pooled endpoint (one per transport and peer engine) of the first transport that
        reaches ``desc`` (a dead one is replaced, and its engine's descriptors forgotten);
        `TransferError` if none opens."""
        for t in self.transports:
            if t.can_reach(desc):
                return self._pooled(t.name, desc, functools.partial(t.connect, desc))
        raise TransferError(f"no configured transport {self.ctx.config.transports} reaches "
                            f"segment {desc.name!r}")

    def _pooled(self, transport: str, desc: SegmentDescriptor,
                make: Callable[[], Endpoint]) -> Endpoint:
        key = (transport, desc.engine_id, desc.address)
        ep = self.pool.get(key)
        if ep is not None:
            if ep.alive:
                return ep
            self.pool.pop(key)
            self._forget_engine(desc.engine_id)
            ep.close()
        return self.pool.get_or_create(key, make)

    def connect(self, plan: Plan) -> tuple[Plan, dict[str, Endpoint | str]]:
        """Each segment's endpoint (or why there is none) for a validated batch, and the plan
        with the descriptors of segments found stale replaced by their fresh ones (a request
        out of range of the fresh one fails with its range error)."""
        eps: dict[str, Endpoint | str] = {}
        fresh: dict[str, SegmentDescriptor] = {}
        for r, _, desc in plan:
            if r.segment not in eps:
                eps[r.segment], new = self._open(r.segment, desc)
                if new is not desc:
                    fresh[r.segment] = new
        if not fresh:
            return plan, eps
        out: Plan = []
        for r, local, desc in plan:
            renewed = fresh.get(r.segment)
            if renewed is not None:
                desc = renewed
                try:
                    check_range(r.segment, renewed.size, r.offset, local.nbytes)
                except TransferError as e:
                    eps[r.segment] = str(e)
            out.append((r, local, desc))
        return out, eps

    def _open(self, name: str, desc: SegmentDescriptor
              ) -> tuple[Endpoint | str, SegmentDescriptor]:
        """(endpoint or why none, the descriptor it serves) for segment ``name``: with the
        cached ``desc`` if it reaches a live segment, else with a fresh lookup if that
        differs. With p2p metadata (whose lookup asks the owner's address itself) an address
        that did not answer is not asked again in this batch: the next batch does."""
        ep, why, unreachable = self._reach(desc)
        if ep is not None:
            return ep, desc
        if unreachable and self.metadata.asks_owner:  # a lookup would ask the same address
            self._descs.pop(name, None)  # the next batch looks it up again
            return why, desc
        new = self._refresh(name, desc, why)
        if new is None:
            return why, desc
        ep, why, _ = self._reach(new)
        return (ep if ep is not None else why), new

    def _reach(self, desc: SegmentDescriptor) -> tuple[Endpoint | None, str, bool]:
        """(the endpoint, or None and why, and whether the owner's address did not answer)."""
        try:
            ep = self.endpoint(desc)
        except TransferError as e:
            return None, str(e), isinstance(e, PeerUnreachable)
        why = ep.stale(desc)
        return (None, why, False) if why else (ep, "", False)

    def _refresh(self, name: str, stale: SegmentDescriptor,
                 why: str) -> SegmentDescriptor | None:
        """Drop the cached descriptor of ``name`` (so the next batch looks it up again) and
        look it up now: the fresh descriptor if it differs from ``stale``, else None."""
        self._descs.pop(name, None)
        try:
            new = self.metadata.lookup(name)
        except TransferError as e:
            log.info("segment %s: %s; looking it up again failed: %s", name, why, e)
            return None
        if new is None or new == stale:
            log.info("segment %s: %s (no other descriptor published)", name, why)
            return None
        log.info("segment %s: %s; using its fresh descriptor (engine %s at %s)", name, why,
                 new.engine_id, new.address)
        self._descs[name] = new
        return new

    def notify_endpoint(self, name: str, desc: SegmentDescriptor) -> TcpEndpoint:
        """The TCP endpoint carrying notifications to ``desc``'s owner; on failure the
        descriptor of ``name`` is dropped (looked up again next time) and `TransferError`
        raised."""
        try:
            ep = self._pooled("tcp", desc, lambda: TcpEndpoint(self.ctx, desc))
        except TransferError:
            self._descs.pop(name, None)
            raise
        assert isinstance(ep, TcpEndpoint)
        return ep
