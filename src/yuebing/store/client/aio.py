"""`AsyncStoreClient`: the asyncio store API (same semantics as `StoreClient`).

Life of a call here: master RPCs share one connection (`AsyncMasterConnection`), so many
coroutines can put/get concurrently; bytes move through the transfer engine's
``submit``/``wait_async``, except same-host ones, copied directly in the loop's thread (`direct`:
~2 ms for 16 MiB). Puts are two-phase (a failed write revokes and re-places; no reserve-ahead
one-RPC puts here, those are `StoreClient`'s), gets verify
checksums, and a heartbeat task keeps the session alive while the client is open.
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
from yuebing.store.client.direct import DirectSegments
from yuebing.store.client.memory import keep_freed_memory, new_buffer
from yuebing.store.client.rpc import AsyncMasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferConfig, TransferEngine, TransferStatus

log = logging.getLogger(__name__)
C = m.Code


class AsyncStoreClient:
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
        self._hb: asyncio.Task[None] | None = None

    async def _transfer(self, reqs: list, deadline: float | None = None) -> BatchStatus:
        """Same-host requests copied directly (`DirectSegments`), the rest through the engine;
        a put's writes end by its write ``deadline`` (monotonic) at the latest."""
        timeout = cm.transfer_timeout(self.cfg, deadline)
        done = self.direct.copy(reqs, time.monotonic() + timeout)
        rest = [r for r, d in zip(reqs, done, strict=True) if d is None]
        if not rest:
            return self.direct.merged(done, None)
        bid = self.engine.submit(rest, cm.transfer_timeout(self.cfg, deadline))
        status = await self.engine.wait_async(bid)
        self.engine.free(bid)
        return status if len(rest) == len(reqs) else self.direct.merged(done, status)

    async def __aenter__(self) -> AsyncStoreClient:
        self._hb = asyncio.get_running_loop().create_task(self._heartbeat())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self.rpc.call(m.Heartbeat(client=self.client_id))
            except StoreError as e:
                log.warning("heartbeat failed: %s", e)

    async def put(self, key: str, value: object, *, replicas: int | None = None,
                  strategy: str | None = None, preferred: Sequence[str] | None = None,
                  hard_pin: bool = False, soft_pin_s: float = 0.0) -> None:
        """Store ``value`` under ``key``; a failed write is revoked (naming the failed
        segments, which the master then avoids) and placed again up to ``put_retries`` times."""
        mv = cm.view(value, writable=False)
        item = cm.put_item(self.cfg, key, mv, replicas, strategy, preferred, hard_pin, soft_pin_s)
        for attempt in range(self.cfg.put_retries + 1):
            sent = time.monotonic()
            targets = await self.rpc.call(m.PutStart(client=self.client_id, item=item))
            assert isinstance(targets, m.PutTargets)
            deadline = cm.write_deadline(sent, targets.expires_in_s)
            reqs = cm.writes(mv, targets.replicas)
            try:
                st = await self._transfer(reqs, deadline)
                failed, why = cm.failed_segments(reqs, st.requests), "; ".join(st.errors)
                blamed = cm.blamed_segments(reqs, st.requests)
            except (TransferError, InputError) as e:
                failed, why = cm.failed_segments(reqs, None), str(e)
                blamed = cm.blamed_segments(reqs, None, e)
            if not failed:
                await self.rpc.call(m.PutEnd(client=self.client_id, key=key))
                return
            with contextlib.suppress(StoreError):
                await self.rpc.call(m.PutRevoke(client=self.client_id, key=key, failed=blamed))
            log.warning("put %s: write to %s failed (attempt %d): %s", key, failed, attempt + 1, why)
        raise StoreError(f"writing {key!r} failed; put revoked: {why}")

    put_from = put

    async def get_into(self, key: str, buf: object) -> int:
        mv = cm.view(buf, writable=True)
        r = await self._replicas(key)
        await self._read(key, mv, r)
        return r.size

    async def get(self, key: str) -> bytearray:
        r = await self._replicas(key)
        out = new_buffer(r.size)
        await self._read(key, memoryview(out), r)
        return out

    async def _replicas(self, key: str) -> m.ReplicaList:
        try:
            r = await self.rpc.call(m.GetReplicas(key=key))
        except StoreRpcError as e:
            if e.code == C.NOT_FOUND:
                raise cm.NotFoundError(f"no value for {key!r}") from None
            raise
        assert isinstance(r, m.ReplicaList)
        return r

    async def _read(self, key: str, mv: memoryview, r: m.ReplicaList) -> None:
        errors = []
        for rep in r.replicas:
            try:
                (await self._transfer([cm.read(mv, key, r.size, rep)])).raise_for_status()
            except TransferError as e:
                errors.append(str(e))
                continue
            cm.verify(self.cfg, key, mv, r.size, r.checksum)
            return
        raise StoreError(f"no replica of {key!r} could be read: {'; '.join(errors)}")

    async def batch_get_into(self, keys: Sequence[str], bufs: Sequence[object]) -> list[int]:
        if len(keys) != len(bufs):
            raise InputError(f"{len(keys)} keys but {len(bufs)} buffers")
        mvs = [cm.view(b, writable=True) for b in bufs]
        r = await self.rpc.call(m.BatchGetReplicas(keys=list(keys)))
        assert isinstance(r, m.BatchReplicaList)
        sizes = [-1] * len(keys)
        reqs, idx = [], []
        for i, code in enumerate(r.codes):
            if code == C.OK:
                reqs.append(cm.read(mvs[i], keys[i], r.sizes[i], r.replicas[i][0]))
                idx.append(i)
            elif code == C.PROMOTING:
                sizes[i] = await self.get_into(keys[i], mvs[i])
        if reqs:
            st = await self._transfer(reqs)
            for j, rs in zip(idx, st.requests, strict=True):
                if rs.status == TransferStatus.DONE:
                    cm.verify(self.cfg, keys[j], mvs[j], r.sizes[j], r.checksums[j])
                    sizes[j] = r.sizes[j]
        return sizes

    async def batch_put(self, keys: Sequence[str], values: Sequence[object]) -> list[int]:
        """Concurrent puts (one coroutine per key); returns a `Code` per key."""
        async def one(k: str, v: object) -> int:
            try:
                await self.put(k, v)
                return 0
            except StoreRpcError as e:
                return int(e.code)
            except StoreError:
                return int(C.INTERNAL)

        return list(await asyncio.gather(*(one(k, v) for k, v in zip(keys, values, strict=True))))

    async def exists(self, key: str) -> bool:
        return (await self.rpc.call(m.Exists(key=key))).values[0]  # type: ignore[attr-defined]

    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return (await self.rpc.call(m.BatchExists(keys=list(keys)))).values  # type: ignore[attr-defined]

    async def prefix_match(self, keys: Sequence[str]) -> int:
        return (await self.rpc.call(m.PrefixMatch(keys=list(keys)))).n  # type: ignore[attr-defined]

    async def remove(self, key: str, force: bool = False) -> None:
        await self.rpc.call(m.Remove(key=key, force=force))

    async def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return (await self.rpc.call(m.BatchRemove(keys=list(keys), force=force))).codes  # type: ignore[attr-defined]

    async def remove_prefix(self, prefix: str, force: bool = False) -> int:
        return (await self.rpc.call(m.RemovePrefix(prefix=prefix, force=force))).n  # type: ignore[attr-defined]

    async def remove_all(self, force: bool = False) -> int:
        return (await self.rpc.call(m.RemoveAll(force=force))).n  # type: ignore[attr-defined]

    async def close(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._hb
        self.rpc.close()
        self.direct.close()
        if self._own_engine:
            self.engine.close()
