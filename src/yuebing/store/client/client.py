"""`StoreClient`: the blocking store API.

Puts (single and batch, two-phase or one RPC through reservations held ahead) are `Puts`'s, in
`puts.py`. A get asks ``get_replicas`` (granting a read lease), READs one replica straight into the
caller's buffer (``get_into``: zero-copy) and verifies the checksum. Reads run only within the
lease (less a margin, `cm.read_deadline`): one it cuts, or a fallback to another replica it would
outlast, is not read from those ranges (another value may hold them by then) but asked for again.
Batch forms do one master call and one transfer batch for many keys. Requests to a live node's
segment on this host skip the engine: `DirectSegments` copies them in the calling thread; the
others go through `TransferEngine.transfer_status` (one inline frame when they fit). A heartbeat
thread keeps the session alive.
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
from yuebing.store.client.puts import Puts
from yuebing.store.client.rpc import (
    RELEASE_FLUSH_S,
    MasterConnection,
    StoreRpcError,
    removed_codes,
)
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferConfig, TransferEngine, TransferStatus

log = logging.getLogger(__name__)
C = m.Code


class StoreClient(Puts):
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
        """Heartbeats every ``heartbeat_s`` on a connection of its own; in between, every
        `RELEASE_FLUSH_S`, the lease releases no call of this client carried since."""
        conn = MasterConnection(self.cfg.masters, self.cfg.rpc_timeout_s, self.cfg.failover_s)
        next_hb = time.monotonic() + self.cfg.heartbeat_s
        try:
            while not self._stop.wait(min(RELEASE_FLUSH_S,
                                          max(0.0, next_hb - time.monotonic()))):
                old = self.rpc.take_releases(time.monotonic() - RELEASE_FLUSH_S)
                if old:
                    conn.send_releases(old)
                if time.monotonic() < next_hb:
                    continue
                next_hb = time.monotonic() + self.cfg.heartbeat_s
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
            try:
                mv = buffer(r.size)
                if self._read_one(key, mv, r.size, r.checksum, r.replicas, deadline):
                    return r.size, mv
            finally:  # the read is over: its lease ends now, not at lease_s
                self._release([key], [r.lease_id])
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
            asked = todo
            try:
                todo = self._batch_read_once(keys, mvs, todo, r,
                                             cm.read_deadline(sent, r.lease_s), sizes)
            finally:  # these reads are over: their leases end now
                self._release([keys[i] for i in asked], r.lease_ids or [0] * len(asked))
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

    def _release(self, keys: list[str], ids: list[int]) -> None:
        """Tell the master these reads are over (`MasterConnection.release`: carried by this
        client's next put or remove ahead of its request, so it finds their space evictable
        and their keys removable, by a read once many are queued, or sent by the heartbeat
        thread ~`RELEASE_FLUSH_S` later)."""
        held = cm.released(keys, ids)
        if held is not None:
            self.rpc.release(*held)

    # ------------------------------------------------------------------ queries / removal
    def exists(self, key: str) -> bool:
        return self.rpc.call(m.Exists(key=key)).values[0]  # type: ignore[attr-defined]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        return self.rpc.call(m.BatchExists(keys=list(keys))).values  # type: ignore[attr-defined]

    def prefix_match(self, keys: Sequence[str]) -> int:
        """How many leading keys of ``keys`` are stored (the reusable prefix length in blocks)."""
        return self.rpc.call(m.PrefixMatch(keys=list(keys))).n  # type: ignore[attr-defined]

    def remove(self, key: str, force: bool = False) -> None:
        """Remove ``key``; `StoreRpcError` NOT_FOUND if absent, unless the request had to be
        resent (its first reply lost, e.g. at a failover): then the first try removed it."""
        try:
            self.rpc.call(m.Remove(key=key, force=force))
        except StoreRpcError as e:
            if not (e.code == C.NOT_FOUND and e.resent):
                raise

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """A `Code` per key (NOT_FOUND counts as OK when the request had to be resent)."""
        r, resent = self.rpc.call_tracked(m.BatchRemove(keys=list(keys), force=force))
        return removed_codes(r.codes, resent)  # type: ignore[attr-defined]

    def remove_prefix(self, prefix: str, force: bool = False) -> m.Removed:
        """Remove every value whose key starts with ``prefix``: `messages.Removed` counts those
        removed (``n``) and those kept (``kept``: a read in flight leases them, ``leased``, or
        they are hard-pinned, ``pinned``; ``force`` removes them too)."""
        r = self.rpc.call(m.RemovePrefix(prefix=prefix, force=force))
        assert isinstance(r, m.Removed)
        return r

    def remove_all(self, force: bool = False) -> m.Removed:
        """`remove_prefix` of every key."""
        r = self.rpc.call(m.RemoveAll(force=force))
        assert isinstance(r, m.Removed)
        return r

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
            self._revoke([], [], held)  # never written: freed at once
        if self._hb is not None:
            self._hb.join(timeout=2 * self.cfg.heartbeat_s + self.cfg.rpc_timeout_s)
        if self.rpc.releases:  # lease releases no call carried
            self.rpc.send_releases(self.rpc.take_releases())
        self.rpc.close()
        self.direct.close()
        if self._own_engine:
            self.engine.close()

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
