"""The put side of `StoreClient` (`Puts`, a mixin it inherits): single and batch puts, two-phase
or through reservations held ahead (`reserve`), and revokes.

Life of a put: ``put_start`` at the master (placement + allocation) → WRITE of the bytes to every
replica (`StoreClient._transfer`: a same-host node's segment copied directly, else one inline
frame or the engine's lanes) → ``put_end`` (commit). A failed transfer revokes the put, so no
reader ever sees a partial value. With ``reserve_ahead`` a stream of same-shaped puts costs one
RPC each (the put writes into the reservation its previous one brought and sends
``put_commit``), and a stream of same-shaped batches one RPC per batch (``batch_put_commit``);
any failure there falls back to the two-phase way for those values. One thread at a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.store import messages as m
from yuebing.store.client import batchput as bp
from yuebing.store.client import common as cm
from yuebing.store.client import reserve as rv
from yuebing.store.client.rpc import MasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus

log = logging.getLogger(__name__)
C = m.Code


class Puts:
    """Puts of a `StoreClient` (which provides the attributes below and ``_transfer``)."""

    cfg: ClientConfig
    client_id: str
    rpc: MasterConnection
    _resv: rv.HeldReservations
    _transfer: Callable[[list, float], BatchStatus]
    """`StoreClient._transfer`: the writes of a put, by its write deadline."""

    def put(self, key: str, value: object, *, replicas: int | None = None,
            strategy: str | None = None, preferred: Sequence[str] | None = None,
            hard_pin: bool = False, soft_pin_s: float = 0.0,
            best_effort: bool = False) -> int:
        """Store ``value`` (any contiguous buffer) under ``key``; values are immutable. A write
        that fails is revoked (naming the failed segments, which the master then avoids) and
        placed again up to ``put_retries`` times. With ``reserve_ahead``, a put of a shape
        this client holds a reservation for writes into it and commits with one RPC.
        Returns the number of replicas stored: a put that cannot place ``replicas`` copies on
        distinct DRAM segments raises `StoreRpcError` NO_SPACE, unless ``best_effort`` (then
        at least one)."""
        mv = cm.view(value, writable=False)
        item = cm.put_item(self.cfg, key, mv, replicas, strategy, preferred, hard_pin, soft_pin_s,
                           best_effort)
        shape = rv.shape_of(item) if self.cfg.reserve_ahead else None
        if shape is not None and self._put_reserved(item, mv, shape):
            return item.replicas  # a reservation holds every replica of its shape
        reserve_next = shape is not None and self._resv.want(shape)
        for attempt in range(self.cfg.put_retries + 1):
            sent = time.monotonic()
            targets = self.rpc.call(m.PutStart(client=self.client_id, item=item,
                                               reserve_next=reserve_next))
            assert isinstance(targets, m.PutTargets)
            if shape is not None:
                self._resv.keep(shape, targets.reservation, sent)
            failed, blamed, why = self._write(mv, targets.replicas,
                                              cm.write_deadline(sent, targets.expires_in_s))
            if not failed:
                self.rpc.call(m.PutEnd(client=self.client_id, key=key))
                return len(targets.replicas)
            self._revoke([key], blamed, self._resv.touching(failed))
            log.warning("put %s: write to %s failed (attempt %d): %s", key, failed, attempt + 1, why)
        raise StoreError(f"writing {key!r} failed; put revoked: {why}")

    def _write(self, mv: memoryview, replicas: list[m.Replica],
               deadline: float) -> tuple[list[str], list[str], str]:
        """Write one value to its replicas by ``deadline``: `cm.write_outcome`."""
        reqs = cm.writes(mv, replicas)
        return cm.write_outcome(reqs, self._write_batch(reqs, deadline))

    def _write_batch(self, reqs: list, deadline: float) -> BatchStatus | Exception:
        """The transfer of the writes ``reqs`` by ``deadline``: its status, or the
        `TransferError`/`InputError` it raised."""
        try:
            return self._transfer(reqs, deadline)
        except (TransferError, InputError) as e:
            return e

    def _put_reserved(self, item: m.PutItem, mv: memoryview, shape: rv.Shape) -> bool:
        """Put ``item`` through the held reservation of its shape: write into it, then one
        ``put_commit`` (which brings the next reservation). False when there is none usable or
        the write or commit failed (the caller then puts it the two-phase way)."""
        now = time.monotonic()
        stale = self._resv.drop_stale(now)
        if stale:  # too little write time left (any shape): give them back unused
            self._revoke([], [], stale)
        held, _ = self._resv.take(shape, now)
        if held is None:
            return False
        failed, blamed, why = self._write(mv, held.replicas, held.deadline)
        if failed:
            self._revoke([held.key], blamed, self._resv.touching(failed))
            log.warning("put %s: write into reservation on %s failed: %s", item.key, failed, why)
            return False
        sent = time.monotonic()
        try:
            r = self.rpc.call(m.PutCommit(client=self.client_id, reservation=held.key, item=item,
                                          reserve_next=True))
        except StoreRpcError as e:
            log.info("put %s: reservation refused (%s); putting it in two phases", item.key, e)
            return False
        assert isinstance(r, m.PutCommitted)
        self._resv.keep(shape, r.reservation, sent)
        return True

    put_from = put
    """Zero-copy put: the engine reads straight from the caller's (registered) buffer."""

    def batch_put(self, keys: Sequence[str], values: Sequence[object], **kw: object) -> list[int]:
        """Put many values with one master round trip per phase (or one in all, through held
        reservations); returns a `Code` per key. Keys whose write failed are revoked and put
        again up to ``put_retries`` times. The steps are `batchput.BatchPut`'s."""
        items, mvs = bp.items_of(self.cfg, keys, values, kw.get("replicas"),  # type: ignore[arg-type]
                                 kw.get("strategy"), kw.get("preferred"),  # type: ignore[arg-type]
                                 bool(kw.get("hard_pin")), float(kw.get("soft_pin_s") or 0.0))  # type: ignore[arg-type]
        steps = bp.BatchPut(self.cfg, self.client_id, self._resv, items, mvs, claim=False).steps()
        return bp.run(steps, self._do)

    def _do(self, op: bp.Op) -> object:
        """One operation of a batch put (`batchput.run`)."""
        if isinstance(op, bp.Call):
            return self.rpc.call(op.msg)
        if isinstance(op, bp.Write):
            return self._write_batch(op.reqs, op.deadline)
        self._revoke(op.keys, op.failed, op.unused)
        return None

    batch_put_from = batch_put

    def _revoke(self, keys: list[str], failed: list[str], unused: list[str] | None = None) -> None:
        """Revoke the pending puts ``keys`` and give back the reservations ``unused`` (held,
        never written: the master frees them at once)."""
        try:
            self.rpc.call(m.BatchPutRevoke(client=self.client_id, keys=keys, failed=failed,
                                           unused=unused or []))
        except StoreError as e:  # the master reclaims it as a zombie later
            log.warning("revoking %d puts failed: %s", len(keys), e)
