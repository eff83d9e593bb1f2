"""`StoreClient`: the blocking store API.

Life of a put here: ``put_start`` at the master (placement + allocation) → WRITE of the bytes to
every replica through the transfer engine (shared memory on one host, TCP otherwise) →
``put_end`` (commit). A failed transfer revokes the put, so no reader ever sees a partial value.
With ``reserve_ahead`` a stream of same-shaped puts costs one RPC each: the master reserves the
space of the next put ahead (`reserve`), the put writes into it and sends ``put_commit``, which
commits it under the key and hands out the next reservation; any failure there falls back to
the two-phase put for that value.
A get asks ``get_replicas`` (granting a read lease), READs one replica straight into the caller's
buffer (``get_into``: zero-copy) and verifies the checksum. Reads run only within the lease (less
a margin, `cm.read_deadline`): one it cuts, or a fallback to another replica it would outlast, is
not read from those ranges (another value may hold them by then) but asked for again. Batch forms do one master call and
one transfer batch for many keys. Requests to a live node's segment on this host skip the engine:
`DirectSegments` copies them in the calling thread. A heartbeat thread keeps the session alive.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.store import messages as m
from yuebing.store.client import common as cm
from yuebing.store.client import reserve as rv
from yuebing.store.client.direct import DirectSegments
from yuebing.store.client.memory import keep_freed_memory, new_buffer
from yuebing.store.client.rpc import MasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferConfig, TransferEngine, TransferStatus

log = logging.getLogger(__name__)
C = m.Code


class StoreClient:
    """Blocking client; one thread at a time (the heartbeat runs on its own connection)."""

    def __init__(self, cfg: ClientConfig | None = None, engine: TransferEngine | None = None,
                 heartbeat: bool = True) -> None:
        self.cfg = cfg or ClientConfig()
        self.client_id = self.cfg.client_id or f"client-{uuid.uuid4().hex[:10]}"
        self._own_engine = engine is None
        self.engine = engine or TransferEngine(TransferConfig(metadata="p2p"))
        self.rpc = MasterConnection(self.cfg.masters, self.cfg.rpc_timeout_s, self.cfg.failover_s,
                                    spin_s=self.cfg.spin_us * 1e-6)
        self.direct = DirectSegments(self.engine, self.cfg.direct)
        keep_freed_memory(self.cfg.keep_freed)
        self._resv = rv.HeldReservations()
        self._stop = threading.Event()
        self._hb: threading.Thread | None = None
        if heartbeat:
            self._hb = threading.Thread(target=self._heartbeat, name="store-heartbeat", daemon=True)
            self._hb.start()

    def _heartbeat(self) -> None:
        conn = MasterConnection(self.cfg.masters, self.cfg.rpc_timeout_s, self.cfg.failover_s)
        try:
            while not self._stop.wait(self.cfg.heartbeat_s):
                try:
                    conn.call(m.Heartbeat(client=self.client_id))
                except StoreError as e:
                    log.warning("heartbeat failed: %s", e)
        finally:
            conn.close()

    def _transfer(self, reqs: list, deadline: float | None = None,
                  read: bool = False) -> BatchStatus:
        """Copy what the same-host fast path can, send the rest through the engine; one status
        per request either way. A put's writes end by its write ``deadline`` (monotonic), a
        get's reads (``read``) by its read-lease deadline (`cm.LeaseExpired` if past)."""
        timeout = cm.transfer_timeout(self.cfg, deadline, read)
        done = self.direct.copy(reqs, time.monotonic() + timeout)
        rest = [r for r, d in zip(reqs, done, strict=True) if d is None]
        if not rest:
            return self.direct.merged(done, None)
        status = self.engine.transfer_status(rest, cm.transfer_timeout(self.cfg, deadline, read))
        return status if len(rest) == len(reqs) else self.direct.merged(done, status)

    # ------------------------------------------------------------------ put
    def put(self, key: str, value: object, *, replicas: int | None = None,
            strategy: str | None = None, preferred: Sequence[str] | None = None,
            hard_pin: bool = False, soft_pin_s: float = 0.0) -> None:
        """Store ``value`` (any contiguous buffer) under ``key``; values are immutable. A write
        that fails is revoked (naming the failed segments, which the master then avoids) and
        placed again up to ``put_retries`` times. With ``reserve_ahead``, a put of a shape
        this client holds a reservation for writes into it and commits with one RPC."""
        mv = cm.view(value, writable=False)
        item = cm.put_item(self.cfg, key, mv, replicas, strategy, preferred, hard_pin, soft_pin_s)
        shape = rv.shape_of(item) if self.cfg.reserve_ahead else None
        if shape is not None and self._put_reserved(item, mv, shape):
            return
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
                return
            self._revoke([key, *self._resv.touching(failed)], blamed)
            log.warning("put %s: write to %s failed (attempt %d): %s", key, failed, attempt + 1, why)
        raise StoreError(f"writing {key!r} failed; put revoked: {why}")

    def _write(self, mv: memoryview, replicas: list[m.Replica],
               deadline: float) -> tuple[list[str], list[str], str]:
        """Write one value to its replicas by ``deadline``: (segments that failed, those of
        them to blame in the revoke — `cm.blamed_segments` —, why)."""
        reqs = cm.writes(mv, replicas)
        try:
            st = self._transfer(reqs, deadline)
            return (cm.failed_segments(reqs, st.requests), cm.blamed_segments(reqs, st.requests),
                    "; ".join(st.errors))
        except (TransferError, InputError) as e:
            return cm.failed_segments(reqs, None), cm.blamed_segments(reqs, None, e), str(e)

    def _put_reserved(self, item: m.PutItem, mv: memoryview, shape: rv.Shape) -> bool:
        """Put ``item`` through the held reservation of its shape: write into it, then one
        ``put_commit`` (which brings the next reservation). False when there is none usable or
        the write or commit failed (the caller then puts it the two-phase way)."""
        now = time.monotonic()
        held, stale = self._resv.take(shape, now)
        if stale is not None and stale.deadline > now:  # too little write time left: give
            self._revoke([stale.key], [])  # it back now (past its expiry the master did)
        if held is None:
            return False
        failed, blamed, why = self._write(mv, held.replicas, held.deadline)
        if failed:
            self._revoke([held.key, *self._resv.touching(failed)], blamed)
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
        """Put many values with one master round trip per phase; returns a `Code` per key.
        Keys whose write failed are revoked and put again up to ``put_retries`` times."""
        if len(keys) != len(values):
            raise InputError(f"{len(keys)} keys but {len(values)} values")
        mvs = [cm.view(v, writable=False) for v in values]
        items = [cm.put_item(self.cfg, k, mv, kw.get("replicas"), kw.get("strategy"),  # type: ignore[arg-type]
                             kw.get("preferred"), bool(kw.get("hard_pin")),  # type: ignore[arg-type]
                             float(kw.get("soft_pin_s") or 0.0))  # type: ignore[arg-type]
                 for k, mv in zip(keys, mvs, strict=True)]
        codes = [int(C.INTERNAL)] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(self.cfg.put_retries + 1):
            todo = self._batch_put_once(todo, items, mvs, codes)
            if not todo:
                break
        return codes

    def _batch_put_once(self, todo: list[int], items: list[m.PutItem], mvs: list[memoryview],
                        codes: list[int]) -> list[int]:
        """One attempt for the items ``todo``; fills ``codes``, returns those to retry. Items
        of one shape go through held reservations when there are enough (`_batch_put_reserved`)
        and ask for the next batch's; the rest are put in two phases."""
        shape = rv.shape_of(items[todo[0]]) if self.cfg.reserve_ahead and \
            len(todo) <= rv.MAX_PER_SHAPE and all(
                rv.shape_of(items[i]) == rv.shape_of(items[todo[0]]) for i in todo) else None
        if shape is not None:
            todo = self._batch_put_reserved(todo, items, mvs, codes, shape)
            if not todo:
                return []
        sent = time.monotonic()
        reserve_next = len(todo) if shape is not None and self._resv.want(shape) else 0
        r = self.rpc.call(m.BatchPutStart(client=self.client_id, items=[items[i] for i in todo],
                                          reserve_next=reserve_next))
        assert isinstance(r, m.BatchPutTargets)
        if shape is not None:
            self._resv.keep_many(shape, r.reservations, sent)
        deadline = cm.write_deadline(sent, r.expires_in_s)
        reqs, owner = [], []
        for i, code, reps in zip(todo, r.codes, r.replicas, strict=True):
            codes[i] = code
            if code == C.OK:
                for req in cm.writes(mvs[i], reps):
                    reqs.append(req)
                    owner.append(i)
        failed: set[int] = set()
        bad: list[str] = []
        if reqs:
            try:
                st = self._transfer(reqs, deadline)
                failed = {owner[j] for j, rs in enumerate(st.requests) if rs.status != TransferStatus.DONE}
                bad = cm.blamed_segments(reqs, st.requests)
            except (TransferError, InputError) as e:
                log.warning("batch put transfer failed: %s", e)
                failed, bad = set(owner), cm.blamed_segments(reqs, None, e)
        ok = [i for i in todo if codes[i] == C.OK and i not in failed]
        if failed:
            self._revoke([items[i].key for i in sorted(failed)], bad)
            for i in failed:
                codes[i] = int(C.INTERNAL)
        if ok:
            ends = self.rpc.call(m.BatchPutEnd(client=self.client_id, keys=[items[i].key for i in ok]))
            for i, c in zip(ok, ends.codes, strict=True):  # type: ignore[attr-defined]
                codes[i] = c
        return sorted(failed)

    def _batch_put_reserved(self, todo: list[int], items: list[m.PutItem],
                            mvs: list[memoryview], codes: list[int], shape: rv.Shape) -> list[int]:
        """Put the items ``todo`` (one shape) through as many held reservations: one write, one
        ``batch_put_commit`` (which brings the next batch's). Fills ``codes`` of the items it
        stored (or found existing); returns the items left to the two-phase way — all of them
        when too few reservations are held or the write or commit failed."""
        now = time.monotonic()
        held, stale = self._resv.take_many(shape, len(todo), now)
        if stale and any(h.deadline > now for h in stale):  # give back what the master holds
            self._revoke([h.key for h in stale if h.deadline > now], [])
        if not held:
            return todo
        reqs = [req for i, h in zip(todo, held, strict=True) for req in cm.writes(mvs[i], h.replicas)]
        try:
            st = self._transfer(reqs, min(h.deadline for h in held))
            failed, bad = cm.failed_segments(reqs, st.requests), cm.blamed_segments(reqs, st.requests)
        except (TransferError, InputError) as e:
            failed, bad = cm.failed_segments(reqs, None), cm.blamed_segments(reqs, None, e)
        if failed:
            self._revoke([h.key for h in held] + self._resv.touching(failed), bad)
            log.warning("batch put: write into reservations on %s failed", failed)
            return todo
        sent = time.monotonic()
        try:
            r = self.rpc.call(m.BatchPutCommit(
                client=self.client_id, reservations=[h.key for h in held],
                items=[items[i] for i in todo], reserve_next=len(todo)))
        except StoreRpcError as e:
            log.info("batch put: reservations refused (%s); putting it in two phases", e)
            return todo
        assert isinstance(r, m.BatchPutCommitted)
        self._resv.keep_many(shape, r.reservations, sent)
        left = []
        for i, code in zip(todo, r.codes, strict=True):
            if code in (C.OK, C.EXISTS):
                codes[i] = code
            else:  # its reservation refused it (and stays the master's): two phases
                left.append(i)
        return left

    batch_put_from = batch_put

    def _revoke(self, keys: list[str], failed: list[str]) -> None:
        try:
            self.rpc.call(m.BatchPutRevoke(client=self.client_id, keys=keys, failed=failed))
        except StoreError as e:  # the master reclaims it as a zombie later
            log.warning("revoking %d puts failed: %s", len(keys), e)

    # ------------------------------------------------------------------ get
    def _replicas(self, key: str) -> tuple[m.ReplicaList, float]:
        """``get_replicas`` (a fresh read lease) and the lease's read deadline here
        (`cm.read_deadline`, from before the request); `NotFoundError` if absent."""
        sent = time.monotonic()
        try:
            r = self.rpc.call(m.GetReplicas(key=key))
        except StoreError as e:
            if getattr(e, "code", None) == C.NOT_FOUND:
                raise cm.NotFoundError(f"no value for {key!r}") from None
            raise
        assert isinstance(r, m.ReplicaList)
        return r, cm.read_deadline(sent, r.lease_s)

    def get_into(self, key: str, buf: object) -> int:
        """Read ``key`` straight into ``buf``; returns the value's size."""
        mv = cm.view(buf, writable=True)
        return self._get_leased(key, lambda size: mv)[0]

    def get(self, key: str) -> bytearray:
        """The value of ``key`` in a new buffer; `NotFoundError` if absent."""
        bufs: list[bytearray] = []

        def buffer(size: int) -> memoryview:
            if not bufs or len(bufs[0]) != size:  # the first lease, or the key was re-put
                bufs[:] = [new_buffer(size)]
            return memoryview(bufs[0])

        self._get_leased(key, buffer)
        return bufs[0]

    def _get_leased(self, key: str, buffer: cm.BufferFor) -> tuple[int, memoryview]:
        """Ask for ``key``'s replicas and read one into ``buffer(size)`` within the read lease;
        when the lease runs out first, ask again (up to ``put_retries`` times) rather than read
        ranges that may hold another value by now, then `cm.ReadLeaseExpired`."""
        for _ in range(self.cfg.put_retries + 1):
            r, deadline = self._replicas(key)
            mv = buffer(r.size)
            if self._read_one(key, mv, r.size, r.checksum, r.replicas, deadline):
                return r.size, mv
            log.info("get %s: its read lease (%.3fs) ran out before a replica was read; "
                     "asking again", key, r.lease_s)
        raise cm.ReadLeaseExpired(
            f"reading {key!r}: each of {self.cfg.put_retries + 1} read leases ({r.lease_s}s) "
            "ran out before a replica could be read (the reads were too slow)")

    def _read_one(self, key: str, mv: memoryview, size: int, checksum: int,
                  replicas: list[m.Replica], deadline: float) -> bool:
        """Read one of ``replicas`` (in order) into ``mv`` and verify it; False when the read
        ``deadline`` passed before one was read (no attempt starts or runs past it; not the
        nodes' failure), `StoreError` when every replica failed within it."""
        errors = []
        for rep in replicas:
            try:
                self._transfer([cm.read(mv, key, size, rep)], deadline, True).raise_for_status()
            except TransferError as e:
                if time.monotonic() >= deadline:  # cut by the lease (or starting past it)
                    return False
                errors.append(str(e))
                continue
            cm.verify(self.cfg, key, mv, size, checksum)
            return True
        raise StoreError(f"no replica of {key!r} could be read: {'; '.join(errors)}")

    def batch_get_into(self, keys: Sequence[str], bufs: Sequence[object]) -> list[int]:
        """Read many keys into their buffers with one master call and one transfer batch;
        returns each value's size, or -1 where the key is absent or its read failed."""
        if len(keys) != len(bufs):
            raise InputError(f"{len(keys)} keys but {len(bufs)} buffers")
        mvs = [cm.view(b, writable=True) for b in bufs]
        return self._batch_read(keys, mvs, None)

    def _batch_read(self, keys: Sequence[str], mvs: list[memoryview],
                    first: tuple[m.BatchReplicaList, float] | None) -> list[int]:
        """Read ``keys`` into ``mvs`` (``first``: their replicas already asked for and the
        monotonic time that request left, else None); keys whose read lease ran out before
        they were read are asked for again (one batch call, up to ``put_retries`` times) and
        read within the new lease; -1 where absent or unread."""
        sizes = [-1] * len(keys)
        todo = list(range(len(keys)))
        for _ in range(self.cfg.put_retries + 1):
            if first is None:
                sent = time.monotonic()
                r = self.rpc.call(m.BatchGetReplicas(keys=[keys[i] for i in todo]))
                assert isinstance(r, m.BatchReplicaList)
            else:
                (r, sent), first = first, None
            todo = self._batch_read_once(keys, mvs, todo, r, cm.read_deadline(sent, r.lease_s),
                                         sizes)
            if not todo:
                return sizes
        log.warning("batch get: %d keys left unread, each of their %d read leases ran out "
                    "before a replica was read", len(todo), self.cfg.put_retries + 1)
        return sizes

    def _batch_read_once(self, keys: Sequence[str], mvs: list[memoryview], todo: list[int],
                         r: m.BatchReplicaList, deadline: float, sizes: list[int]) -> list[int]:
        """One transfer batch for ``todo`` (``r`` answers those keys in order) by ``deadline``,
        then the other replicas of keys that failed, one by one while the lease lasts; fills
        ``sizes``, returns the keys to ask for again (their lease ran out first)."""
        reqs, idx, promoting = cm.batch_reads(keys, mvs, todo, r)
        for i in promoting:  # SSD-only: a single get waits for the promotion
            sizes[i] = self.get_into(keys[i], mvs[i])
        if not reqs:
            return []
        try:
            statuses = self._transfer(reqs, deadline, True).requests
        except cm.LeaseExpired:
            return [i for i, *_ in idx]
        again = []
        for (i, size, sum_, reps), rs in zip(idx, statuses, strict=True):
            if rs.status == TransferStatus.DONE:  # a mismatch raises `cm.ChecksumError`
                cm.verify(self.cfg, keys[i], mvs[i], size, sum_)
                sizes[i] = size
                continue
            try:
                if time.monotonic() >= deadline or not self._read_one(
                        keys[i], mvs[i], size, sum_, reps[1:], deadline):
                    again.append(i)  # the lease ran out: the node is not to blame
                    continue
                sizes[i] = size
            except StoreError as e:
                log.warning("reading %s failed: %s", keys[i], e)
        return again

    def batch_get(self, keys: Sequence[str]) -> list[bytearray | None]:
        """Values of many keys (None where absent or unreadable)."""
        sent = time.monotonic()
        reps = self.rpc.call(m.BatchGetReplicas(keys=list(keys)))
        assert isinstance(reps, m.BatchReplicaList)
        promoted: dict[int, bytearray] = {}
        for i, code in enumerate(reps.codes):
            if code == C.PROMOTING:  # SSD-only: a single get waits for the promotion
                promoted[i] = self.get(keys[i])
                reps.codes[i] = int(C.NOT_FOUND)
        bufs = [new_buffer(max(s, 1)) for s in reps.sizes]
        sizes = self._batch_read(keys, [memoryview(b) for b in bufs], (reps, sent))
        out: list[bytearray | None] = [b if s == len(b) else (b[:s] if s >= 0 else None)
                                       for b, s in zip(bufs, sizes, strict=True)]
        for i, v in promoted.items():
            out[i] = v
        return out

    # ------------------------------------------------------------------ queries / removal
    def exists(self, key: str) -> bool:
        return self.rpc.call(m.Exists(key=key)).values[0]  # type: ignore[attr-defined]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.rpc.call(m.BatchExists(keys=list(keys))).values  # type: ignore[attr-defined]

    def prefix_match(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` are stored (the reusable prefix length in blocks)."""
        return self.rpc.call(m.PrefixMatch(keys=list(keys))).n  # type: ignore[attr-defined]

    def remove(self, key: str, force: bool = False) -> None:
        self.rpc.call(m.Remove(key=key, force=force))

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        return self.rpc.call(m.BatchRemove(keys=list(keys), force=force)).codes  # type: ignore[attr-defined]

    def remove_prefix(self, prefix: str, force: bool = False) -> int:
        return self.rpc.call(m.RemovePrefix(prefix=prefix, force=force)).n  # type: ignore[attr-defined]

    def remove_all(self, force: bool = False) -> int:
        return self.rpc.call(m.RemoveAll(force=force)).n  # type: ignore[attr-defined]

    def pin(self, keys: Sequence[str], hard: bool = False, soft_pin_s: float = 0.0,
            unpin: bool = False) -> list[int]:
        return self.rpc.call(m.Pin(keys=list(keys), hard=hard, soft_pin_s=soft_pin_s,
                                   unpin=unpin)).codes  # type: ignore[attr-defined]

    def stats(self) -> dict[str, float]:
        return self.rpc.call(m.GetStats()).values  # type: ignore[attr-defined]

    def close(self) -> None:
        """Stop the heartbeat, give back held reservations (one try, at most ``rpc_timeout_s``;
        else the master reclaims them at their write expiry), release everything."""
        self._stop.set()
        held = self._resv.pop_all()
        if held:
            self.rpc.failover_s = 0.0
            self._revoke(held, [])
        if self._hb is not None:
            self._hb.join(timeout=2 * self.cfg.heartbeat_s + self.cfg.rpc_timeout_s)
        self.rpc.close()
        self.direct.close()
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
