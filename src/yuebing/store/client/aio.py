"""`AsyncStoreClient`: the asyncio store API (same semantics as `StoreClient`).

Life of a call here: master RPCs share one connection (`AsyncMasterConnection`), so many
coroutines can put/get concurrently; bytes move through the transfer engine's
``submit``/``wait_async``, except same-host ones, copied directly in the loop's thread (`direct`:
~2 ms for 16 MiB). The put side is `aio_puts.AsyncPuts`: puts are two-phase (a failed write
revokes and re-places) or, with ``reserve_ahead``, one RPC for a stream of same-shaped values (a
write into a reservation held for the shape and a ``put_commit``); a batch put is the sync
client's protocol (`batchput`: one ``batch_put_start``, one transfer batch, one
``batch_put_end``, or one write into n held reservations and one ``batch_put_commit``). Of puts
and batches running concurrently, one writes into a held reservation — `HeldReservations.claim`
/ ``claim_many`` pop it with no await in between, and keep it out of later replies — while the
others of that shape go the two-phase way. Gets verify checksums, and a heartbeat task keeps the
session alive while the client is open; ``close`` gives held reservations back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Sequence

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.store import messages as m
from yuebing.store.client import common as cm
from yuebing.store.client import reserve as rv
from yuebing.store.client.aio_puts import AsyncPuts
from yuebing.store.client.direct import DirectSegments
from yuebing.store.client.memory import keep_freed_memory, new_buffer
from yuebing.store.client.rpc import (
    RELEASE_FLUSH_S,
    AsyncMasterConnection,
    StoreRpcError,
    removed_codes,
)
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferConfig, TransferEngine, TransferStatus

log = logging.getLogger(__name__)
C = m.Code


class AsyncStoreClient(AsyncPuts):
    """Use as ``async with AsyncStoreClient(cfg) as c: await c.put(...)``."""

    def __init__(self, cfg: ClientConfig | None = None, engine: TransferEngine | None = None) -> None:
        self.cfg = cfg or ClientConfig()
        self.client_id = self.cfg.client_id or f"aclient-{uuid.uuid4().hex[:10]}"
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(TransferConfig(metadata="p2p"))
        self.rpc = AsyncMasterConnection(self.cfg.masters, self.cfg.rpc_timeout_s,
                                         self.cfg.failover_s)
        self.direct = DirectSegments(self.engine, self.cfg.direct)
        keep_freed_memory(self.cfg.keep_freed)
        self._resv = rv.HeldReservations()
        self._hb: asyncio.Task[None] | None = None

    async def _transfer(self, reqs: list, deadline: float | None = None,
                        read: bool = False) -> BatchStatus:
        """Same-host requests copied directly (`DirectSegments`), the rest through the engine;
        a put's writes end by its write ``deadline`` (monotonic) at the latest, a get's reads
        (``read``) by its read-lease deadline (`cm.LeaseExpired` if past already)."""
        timeout = cm.transfer_timeout(self.cfg, deadline, read)
        done = self.direct.copy(reqs, time.monotonic() + timeout)
        rest = [r for r, d in zip(reqs, done, strict=True) if d is None]
        if not rest:
            return self.direct.merged(done, None)
        bid = self.engine.submit(rest, cm.transfer_timeout(self.cfg, deadline, read))
        status = await self.engine.wait_async(bid)
        self.engine.free(bid)
        return status if len(rest) == len(reqs) else self.direct.merged(done, status)

    async def __aenter__(self) -> AsyncStoreClient:
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _heartbeat(self) -> None:
        """Heartbeats every ``heartbeat_s``; in between, every `RELEASE_FLUSH_S`, the lease
        releases no call carried since."""
        next_hb = time.monotonic() + self.cfg.heartbeat_s
        while True:
            await asyncio.sleep(min(RELEASE_FLUSH_S, max(0.0, next_hb - time.monotonic())))
            self.rpc.flush_releases(time.monotonic() - RELEASE_FLUSH_S)
            if time.monotonic() < next_hb:
                continue
            next_hb = time.monotonic() + self.cfg.heartbeat_s
            try:
                await self.rpc.call(m.Heartbeat(client=self.client_id))
            except StoreError as e:
                log.warning("heartbeat failed: %s", e)

    async def get_into(self, key: str, buf: object) -> int:
        """Read ``key`` straight into ``buf``; returns the value's size."""
        mv = cm.view(buf, writable=True)
        return (await self._get_leased(key, lambda size: mv))[0]

    async def get(self, key: str) -> bytearray:
        """The value of ``key`` in a new buffer; `NotFoundError` if absent."""
        bufs: list[bytearray] = []

        def buffer(size: int) -> memoryview:
            if not bufs or len(bufs[0]) != size:  # the first lease, or the key was re-put
                bufs[:] = [new_buffer(size)]
            return memoryview(bufs[0])

        await self._get_leased(key, buffer)
        return bufs[0]

    async def _replicas(self, key: str) -> tuple[m.ReplicaList, float]:
        """``get_replicas`` (a fresh read lease) and its read deadline (`cm.read_deadline`)."""
        sent = time.monotonic()
        try:
            r = await self.rpc.call(m.GetReplicas(key=key))
        except StoreRpcError as e:
            if e.code == C.NOT_FOUND:
                raise cm.NotFoundError(f"no value for {key!r}") from None
            raise
        assert isinstance(r, m.ReplicaList)
        return r, cm.read_deadline(sent, r.lease_s)

    async def _get_leased(self, key: str, buffer: cm.BufferFor) -> tuple[int, memoryview]:
        """`StoreClient._get_leased`: read within the read lease, else ask again (up to
        ``put_retries`` times), then `cm.ReadLeaseExpired`."""
        for _ in range(self.cfg.put_retries + 1):
            r, deadline = await self._replicas(key)
            try:
                mv = buffer(r.size)
                if await self._read(key, mv, r.size, r.checksum, r.replicas, deadline):
                    return r.size, mv
            finally:  # the read is over: its lease ends now, not at lease_s
                self._release([key], [r.lease_id])
            log.info("get %s: its read lease (%.3fs) ran out before a replica was read; "
                     "asking again", key, r.lease_s)
        raise cm.ReadLeaseExpired(
            f"reading {key!r}: each of {self.cfg.put_retries + 1} read leases ({r.lease_s}s) "
            "ran out before a replica could be read (the reads were too slow)")

    async def _read(self, key: str, mv: memoryview, size: int, checksum: int,
                    replicas: list[m.Replica], deadline: float) -> bool:
        """`StoreClient._read_one`: False when the read ``deadline`` passed first."""
        errors = []
        for rep in replicas:
            try:
                (await self._transfer([cm.read(mv, key, size, rep)], deadline,
                                      True)).raise_for_status()
            except TransferError as e:
                if time.monotonic() >= deadline:  # cut by the lease (or starting past it)
                    return False
                errors.append(str(e))
                continue
            cm.verify(self.cfg, key, mv, size, checksum)
            return True
        raise StoreError(f"no replica of {key!r} could be read: {'; '.join(errors)}")

    async def batch_get_into(self, keys: Sequence[str], bufs: Sequence[object]) -> list[int]:
        """Read many keys into their buffers (one master call and one transfer batch per
        lease); each value's size, or -1 where absent or unread. Keys whose read lease ran out
        before they were read are asked for again, up to ``put_retries`` times."""
        if len(keys) != len(bufs):
            raise InputError(f"{len(keys)} keys but {len(bufs)} buffers")
        mvs = [cm.view(b, writable=True) for b in bufs]
        return await self._batch_read(keys, mvs, None)

    async def batch_get(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Values of many keys (None where absent or unreadable): `StoreClient.batch_get`."""
        sent = time.monotonic()
        reps = await self.rpc.call(m.BatchGetReplicas(keys=list(keys)))
        assert isinstance(reps, m.BatchReplicaList)
        promoted: dict[int, bytearray] = {}
        for i, code in enumerate(reps.codes):
            if code == C.PROMOTING:  # SSD-only: a single get waits for the promotion
                promoted[i] = await self.get(keys[i])
                reps.codes[i] = int(C.NOT_FOUND)
        bufs = [new_buffer(max(s, 1)) for s in reps.sizes]
        sizes = await self._batch_read(keys, [memoryview(b) for b in bufs], (reps, sent))
        out = cm.batch_values(bufs, sizes)
        for i, v in promoted.items():
            out[i] = v
        return out

    async def _batch_read(self, keys: Sequence[str], mvs: list[memoryview],
                          first: tuple[m.BatchReplicaList, float] | None) -> list[int]:
        """`StoreClient._batch_read`: read ``keys`` into ``mvs`` (``first``: their replicas
        already asked for and when that request left), asking again for keys whose read lease
        ran out first (up to ``put_retries`` times); -1 where absent or unread."""
        sizes = [-1] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(self.cfg.put_retries + 1):
            if first is None:
                sent = time.monotonic()
                r = await self.rpc.call(m.BatchGetReplicas(keys=[keys[i] for i in todo]))
                assert isinstance(r, m.BatchReplicaList)
            else:
                (r, sent), first = first, None
            asked = todo
            try:
                todo = await self._batch_read_once(keys, mvs, todo, r,
                                                   cm.read_deadline(sent, r.lease_s), sizes)
            finally:  # these reads are over: their leases end now
                self._release([keys[i] for i in asked], r.lease_ids or [0] * len(asked))
            if not todo:
                return sizes
        log.warning("batch get: %d keys left unread, each of their %d read leases ran out "
                    "before a replica was read", len(todo), self.cfg.put_retries + 1)
        return sizes

    async def _batch_read_once(self, keys: Sequence[str], mvs: list[memoryview],
                               todo: list[int], r: m.BatchReplicaList, deadline: float,
                               sizes: list[int]) -> list[int]:
        """`StoreClient._batch_read_once`: returns the keys whose lease ran out first."""
        reqs, idx, promoting = cm.batch_reads(keys, mvs, todo, r)
        for i in promoting:  # SSD-only: a single get waits for the promotion
            sizes[i] = await self.get_into(keys[i], mvs[i])
        if not reqs:
            return []
        try:
            statuses = (await self._transfer(reqs, deadline, True)).requests
        except cm.LeaseExpired:
            return [i for i, *_ in idx]
        again = []
        for (i, size, sum_, reps), rs in zip(idx, statuses, strict=True):
            if rs.status == TransferStatus.DONE:  # a mismatch raises `cm.ChecksumError`
                cm.verify(self.cfg, keys[i], mvs[i], size, sum_)
                sizes[i] = size
                continue
            try:
                if time.monotonic() >= deadline or not await self._read(
                        keys[i], mvs[i], size, sum_, reps[1:], deadline):
                    again.append(i)  # the lease ran out: the node is not to blame
                    continue
                sizes[i] = size
            except StoreError as e:
                log.warning("reading %s failed: %s", keys[i], e)
        return again

    async def exists(self, key: str) -> bool:
        return (await self.rpc.call(m.Exists(key=key))).values[0]  # type: ignore[attr-defined]

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return (await self.rpc.call(m.BatchExists(keys=list(keys)))).values  # type: ignore[attr-defined]

    async def prefix_match(self, keys: Sequence[str]) -> int:
        return (await self.rpc.call(m.PrefixMatch(keys=list(keys)))).n  # type: ignore[attr-defined]

    async def remove(self, key: str, force: bool = False) -> None:
        """As `StoreClient.remove` (a resent remove answered NOT_FOUND succeeded)."""
        try:
            await self.rpc.call(m.Remove(key=key, force=force))
        except StoreRpcError as e:
            if not (e.code == C.NOT_FOUND and e.resent):
                raise

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        r, resent = await self.rpc.call_tracked(m.BatchRemove(keys=list(keys), force=force))
        return removed_codes(r.codes, resent)  # type: ignore[attr-defined]

    def _release(self, keys: list[str], ids: list[int]) -> None:
        """`StoreClient._release`: these reads are over (`AsyncMasterConnection.release`)."""
        held = cm.released(keys, ids)
        if held is not None:
            self.rpc.release(*held)

    async def remove_prefix(self, prefix: str, force: bool = False) -> m.Removed:
        """`StoreClient.remove_prefix`: removed and kept (leased, pinned) values."""
        r = await self.rpc.call(m.RemovePrefix(prefix=prefix, force=force))
        assert isinstance(r, m.Removed)
        return r

    async def remove_all(self, force: bool = False) -> m.Removed:
        """`remove_prefix` of every key."""
        r = await self.rpc.call(m.RemoveAll(force=force))
        assert isinstance(r, m.Removed)
        return r

    async def pin(self, keys: Sequence[str], hard: bool = False, soft_pin_s: float = 0.0,
                  unpin: bool = False) -> list[int]:
        """Hard-pin, soft-pin (for ``soft_pin_s``) or, with ``unpin``, clear the pins of
        ``keys``; a `Code` per key."""
        return (await self.rpc.call(m.Pin(keys=list(keys), hard=hard, soft_pin_s=soft_pin_s,
                                          unpin=unpin))).codes  # type: ignore[attr-defined]

    async def stats(self) -> dict[str, float]:
        """The master's counters and gauges (`GetStats`)."""
        return (await self.rpc.call(m.GetStats())).values  # type: ignore[attr-defined]

    async def close(self) -> None:
        """Stop the heartbeat, give back held reservations (one try, at most ``rpc_timeout_s``;
        else the master reclaims them at their write expiry), release everything."""
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        held = self._resv.pop_all()
        if held:
            self.rpc.failover_s = 0.0
            await self._revoke([], [], held)  # never written: freed at once
        self.rpc.flush_releases()  # lease releases no call carried
        self.rpc.close()
        self.direct.close()
        if self._own_engine:
            self.engine.close()
