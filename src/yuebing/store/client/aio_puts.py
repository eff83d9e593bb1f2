"""The put side of `AsyncStoreClient` (`AsyncPuts`, a mixin it inherits; the asyncio twin of
`puts.Puts`): single and batch puts, two-phase or through reservations held ahead, and revokes.

A put is ``put_start`` → write (`AsyncStoreClient._transfer`) → ``put_end``, or with
``reserve_ahead`` a write into the reservation its previous put of the shape brought plus one
``put_commit``. A batch put runs the steps of `batchput.BatchPut` (the sync client's, with
awaits): one ``batch_put_start``, one transfer batch and one ``batch_put_end`` — or, for a stream
of same-shaped batches, one write into n held reservations plus one ``batch_put_commit``. Many
coroutines may put at once through one client: a held reservation is written by exactly one of
them (`HeldReservations.claim` / `claim_many` pop it and mark it busy with no await in between;
a refused commit `release`s it), and the others of that shape go the two-phase way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.store import messages as m
from yuebing.store.client import batchput as bp
from yuebing.store.client import common as cm
from yuebing.store.client import reserve as rv
from yuebing.store.client.rpc import AsyncMasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus

log = logging.getLogger(__name__)


class AsyncPuts:
    """Puts of an `AsyncStoreClient` (which provides the attributes below and ``_transfer``)."""

    cfg: ClientConfig
    client_id: str
    rpc: AsyncMasterConnection
    _resv: rv.HeldReservations
    _transfer: Callable[[list, float], Awaitable[BatchStatus]]
    """`AsyncStoreClient._transfer`: the writes of a put, by its write deadline."""

    async def put(self, key: str, value: object, *, replicas: int | None = None,
                  strategy: str | None = None, preferred: Sequence[str] | None = None,
                  hard_pin: bool = False, soft_pin_s: float = 0.0,
                  best_effort: bool = False) -> int:
        """Store ``value`` under ``key``; a failed write is revoked (naming the failed
        segments, which the master then avoids) and placed again up to ``put_retries`` times.
        With ``reserve_ahead``, a put of a shape this client holds a reservation for (and no
        concurrent put claimed first) writes into it and commits with one RPC.
        Returns the number of replicas stored: a put that cannot place ``replicas`` copies on
        distinct DRAM segments raises `StoreRpcError` NO_SPACE, unless ``best_effort`` (then
        at least one)."""
        mv = cm.view(value, writable=False)
        item = cm.put_item(self.cfg, key, mv, replicas, strategy, preferred, hard_pin, soft_pin_s,
                           best_effort)
        shape = rv.shape_of(item) if self.cfg.reserve_ahead else None
        if shape is not None and await self._put_reserved(item, mv, shape):
            return item.replicas  # a reservation holds every replica of its shape
        reserve_next = shape is not None and self._resv.want(shape)
        for attempt in range(self.cfg.put_retries + 1):
            sent = time.monotonic()
            targets = await self.rpc.call(m.PutStart(client=self.client_id, item=item,
                                                     reserve_next=reserve_next))
            assert isinstance(targets, m.PutTargets)
            if shape is not None:
                self._resv.keep(shape, targets.reservation, sent)
            failed, blamed, why = await self._write(mv, targets.replicas,
                                                    cm.write_deadline(sent, targets.expires_in_s))
            if not failed:
                await self.rpc.call(m.PutEnd(client=self.client_id, key=key))
                return len(targets.replicas)
            await self._revoke([key], blamed, self._resv.touching(failed))
            log.warning("put %s: write to %s failed (attempt %d): %s", key, failed, attempt + 1, why)
        raise StoreError(f"writing {key!r} failed; put revoked: {why}")

    put_from = put

    async def _write(self, mv: memoryview, replicas: list[m.Replica],
                     deadline: float) -> tuple[list[str], list[str], str]:
        """Write one value to its replicas by ``deadline``: `cm.write_outcome`."""
        reqs = cm.writes(mv, replicas)
        return cm.write_outcome(reqs, await self._write_batch(reqs, deadline))

    async def _write_batch(self, reqs: list, deadline: float) -> BatchStatus | Exception:
        """The transfer of the writes ``reqs`` by ``deadline``: its status, or the
        `TransferError`/`InputError` it raised."""
        try:
            return await self._transfer(reqs, deadline)
        except (TransferError, InputError) as e:
            return e

    async def _put_reserved(self, item: m.PutItem, mv: memoryview, shape: rv.Shape) -> bool:
        """`StoreClient._put_reserved`: put ``item`` through the held reservation of its shape
        (claimed by this coroutine alone), False when there is none usable or the write or
        commit failed (the caller then puts it the two-phase way)."""
        now = time.monotonic()
        stale = self._resv.drop_stale(now)
        held, one = self._resv.claim(shape, now)
        if one is not None:
            stale.append(one)
        if stale:  # too little write time left (any shape): give them back unused
            await self._revoke([], [], stale)
        if held is None:
            return False
        failed, blamed, why = await self._write(mv, held.replicas, held.deadline)
        if failed:
            await self._revoke([held.key], blamed, self._resv.touching(failed))
            log.warning("put %s: write into reservation on %s failed: %s", item.key, failed, why)
            return False
        sent = time.monotonic()
        try:
            r = await self.rpc.call(m.PutCommit(client=self.client_id, reservation=held.key,
                                                item=item, reserve_next=True))
        except StoreRpcError as e:
            self._resv.release(held.key)
            log.info("put %s: reservation refused (%s); putting it in two phases", item.key, e)
            return False
        assert isinstance(r, m.PutCommitted)
        self._resv.keep(shape, r.reservation, sent)
        return True

    async def _revoke(self, keys: list[str], failed: list[str],
                      unused: list[str] | None = None) -> None:
        """Revoke the pending puts ``keys`` and give back the reservations ``unused`` (held,
        never written: the master frees them at once)."""
        try:
            await self.rpc.call(m.BatchPutRevoke(client=self.client_id, keys=keys, failed=failed,
                                                 unused=unused or []))
        except StoreError as e:  # the master reclaims it as a zombie later
            log.warning("revoking %d puts failed: %s", len(keys), e)

    async def batch_put(self, keys: Sequence[str], values: Sequence[object], *,
                        replicas: int | None = None, strategy: str | None = None,
                        preferred: Sequence[str] | None = None, hard_pin: bool = False,
                        soft_pin_s: float = 0.0) -> list[int]:
        """`StoreClient.batch_put`: one master round trip per phase (or one in all, through
        reservations held for the shape and not claimed by a concurrent put); returns a `Code`
        per key (0 for OK). Keys whose write failed are revoked and put again up to
        ``put_retries`` times; a refusal of the whole batch raises (`StoreRpcError`)."""
        items, mvs = bp.items_of(self.cfg, keys, values, replicas, strategy, preferred,
                                 hard_pin, soft_pin_s)
        steps = bp.BatchPut(self.cfg, self.client_id, self._resv, items, mvs, claim=True).steps()
        return await bp.run_async(steps, self._do)

    batch_put_from = batch_put
    """Zero-copy batch put: the engine reads straight from the caller's buffers."""

    async def _do(self, op: bp.Op) -> object:
        """One operation of a batch put (`batchput.run_async`)."""
        if isinstance(op, bp.Call):
            return await self.rpc.call(op.msg)
        if isinstance(op, bp.Write):
            return await self._write_batch(op.reqs, op.deadline)
        await self._revoke(op.keys, op.failed, op.unused)
        return None
