"""The store client's read side, written once as step generators for both clients (run by
`core.run` / `core.drive`): `get_leased` (one key, into the caller's buffer or a new one),
`batch_get_into`, `batch_get`; the read deadline a lease allows, checksum verification and
the errors a get raises. Called by `StoreClient` and `AsyncStoreClient` (`client`).

Life of a get (`get_leased`): ``get_replicas`` (a read lease), READ one replica straight into the
caller's buffer and verify its checksum, then release the lease; a value the master holds comes
in the reply (no lease, no read). Reads run only within the
lease (less a margin, `read_deadline`): one it cuts, or a fallback to another replica it would
outlast, is not read from those ranges (another value may hold them by then) but asked for
again, up to ``put_retries`` times. Batch forms do one master call and one transfer batch for
many keys; SSD-only keys being promoted are read with a single get (which waits for it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.protocol import store as m
from yuebing.store.client.core import Call, Read, Release, Steps, checksum, view
from yuebing.store.client.direct import LeaseExpired, new_buffer
from yuebing.store.client.inline import copy_in
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import OpCode, TransferRequest, TransferStatus

log = logging.getLogger(__name__)
C = m.Code
BufferFor = Callable[[int], memoryview]
"""Where a get reads a value of the given size (the caller's buffer or a new one)."""


class ChecksumError(StoreError):
    """A value read back does not match the checksum stored with it."""


class NotFoundError(StoreError, KeyError):
    """No committed value under the key."""


class ReadLeaseExpired(StoreError):
    """Every read lease a get was granted (``put_retries + 1`` of them) ran out before one of
    its replicas could be read: the reads were too slow; no stale bytes were returned."""


def verify(cfg: ClientConfig, key: str, buf: memoryview, size: int, expect: int) -> None:
    if cfg.checksum and expect >= 0:
        got = checksum(buf[:size])
        if got != expect:
            raise ChecksumError(f"checksum mismatch reading {key!r}: stored {expect:#x}, "
                                f"read {got:#x} (corrupted replica)")


LEASE_MARGIN_S = 0.05
"""Least safety margin kept before a read lease ends (clock rates, the reply's own delay)."""


def lease_margin(lease_s: float) -> float:
    """Seconds of a ``lease_s`` lease no read may use: 10 % of it or `LEASE_MARGIN_S`,
    whichever is larger, but at most half the lease (so a tiny lease still leaves time)."""
    return min(max(0.1 * lease_s, LEASE_MARGIN_S), lease_s / 2)


def read_deadline(sent_at: float, lease_s: float) -> float:
    """A get's read deadline on this process's monotonic clock: the master's lease (seconds
    from its reply) counted from ``sent_at``, before the request left (conservative: the
    network delay only shortens it), less `lease_margin`. No read transfer starts or runs past
    it. A lease of 0 (the master grants none) bounds nothing: ``inf``."""
    if lease_s <= 0:
        return float("inf")
    return sent_at + lease_s - lease_margin(lease_s)


def released(keys: Sequence[str], ids: Sequence[int]) -> Release | None:
    """The `Release` of reads of ``keys`` under leases ``ids`` that are over (done, failed or
    cut by the read deadline): those without a lease (id 0) left out; None when none is left.
    The master ends each lease its last reader released."""
    held = [(k, i) for k, i in zip(keys, ids, strict=True) if i]
    if not held:
        return None
    return Release([k for k, _ in held], [i for _, i in held])


def read(buf: memoryview, key: str, size: int, rep: m.Replica) -> TransferRequest:
    if buf.nbytes < size:
        raise InputError(f"buffer of {buf.nbytes} bytes is too small for {key!r} ({size} bytes)")
    return TransferRequest(OpCode.READ, buf, rep.segment, rep.offset, size)


# ---------------------------------------------------------------- single get
def get_leased(cfg: ClientConfig, key: str, buffer: BufferFor) -> Steps[tuple[int, memoryview]]:
    """Ask for ``key``'s replicas and read one into ``buffer(size)`` within the read lease;
    when the lease runs out first, ask again (up to ``put_retries`` times) rather than read
    ranges that may hold another value by now, then `ReadLeaseExpired`. Returns the size and
    the view read into (`into` the caller's buffer, or a `new_value`); `NotFoundError` if
    absent. One generator, not wrapped: a get's three operations pass through no more frames
    than they must."""
    for _ in range(cfg.put_retries + 1):
        sent = time.monotonic()
        try:
            r = yield Call(m.GetReplicas(key=key))
        except StoreRpcError as e:
            if e.code == C.NOT_FOUND:
                raise NotFoundError(f"no value for {key!r}") from None
            raise
        assert isinstance(r, m.ReplicaList)
        if r.value is not None:  # the master holds it: the bytes came in the reply
            mv = buffer(r.size)
            copy_in(key, mv, r.value)
            verify(cfg, key, mv, r.size, r.checksum)
            return r.size, mv
        try:
            mv = buffer(r.size)
            if (yield from read_one(cfg, key, mv, r.size, r.checksum, r.replicas,
                                    read_deadline(sent, r.lease_s))):
                return r.size, mv
        finally:  # the read is over: its lease ends now, not at lease_s
            if r.lease_id:
                yield Release([key], [r.lease_id])
        log.info("get %s: its read lease (%.3fs) ran out before a replica was read; "
                 "asking again", key, r.lease_s)
    raise ReadLeaseExpired(
        f"reading {key!r}: each of {cfg.put_retries + 1} read leases ({r.lease_s}s) "
        "ran out before a replica could be read (the reads were too slow)")


def into(buf: object) -> BufferFor:
    """The `BufferFor` of a get into the caller's ``buf`` (checked writable once, up front)."""
    mv = view(buf, writable=True)
    return lambda size: mv


def new_value(size: int) -> memoryview:
    """The `BufferFor` of a get that returns its value in a new buffer (`value_of`)."""
    return memoryview(new_buffer(size))


def value_of(got: tuple[int, memoryview]) -> bytearray:
    """The new buffer a `get_leased` with `new_value` read its value into."""
    return cast(bytearray, got[1].obj)


def read_one(cfg: ClientConfig, key: str, mv: memoryview, size: int, checksum: int,
             replicas: list[m.Replica], deadline: float) -> Steps[bool]:
    """Read one of ``replicas`` (in order) into ``mv`` and verify it; False when the read
    ``deadline`` passed before one was read (no attempt starts or runs past it; not the
    nodes' failure), `StoreError` when every replica failed within it."""
    errors = []
    for rep in replicas:
        try:
            (yield Read([read(mv, key, size, rep)], deadline)).raise_for_status()
        except TransferError as e:
            if time.monotonic() >= deadline:  # cut by the lease (or starting past it)
                return False
            errors.append(str(e))
            continue
        verify(cfg, key, mv, size, checksum)
        return True
    raise StoreError(f"no replica of {key!r} could be read: {'; '.join(errors)}")


# ---------------------------------------------------------------- batch get
def batch_get_into(cfg: ClientConfig, keys: Sequence[str],
                   bufs: Sequence[object]) -> Steps[list[int]]:
    """Read many keys into their buffers with one master call and one transfer batch
    (`_batch_read`); each value's size, or -1 where the key is absent or its read failed."""
    if len(keys) != len(bufs):
        raise InputError(f"{len(keys)} keys but {len(bufs)} buffers")
    return (yield from _batch_read(cfg, keys, [view(b, writable=True) for b in bufs], None))


def _batch_read(cfg: ClientConfig, keys: Sequence[str], mvs: list[memoryview],
                first: tuple[m.BatchReplicaList, float] | None) -> Steps[list[int]]:
    """Read ``keys`` into ``mvs`` (``first``: their replicas already asked for and the
    monotonic time that request left, else None); keys whose read lease ran out before they
    were read are asked for again (one batch call, up to ``put_retries`` times) and read within
    the new lease. Returns each value's size, -1 where absent or unread."""
    sizes = [-1] * len(keys)
    todo = list(range(len(keys)))
    for _ in range(cfg.put_retries + 1):
        if first is None:
            sent = time.monotonic()
            r = yield Call(m.BatchGetReplicas(keys=[keys[i] for i in todo]))
            assert isinstance(r, m.BatchReplicaList)
        else:
            (r, sent), first = first, None
        asked = todo
        try:
            todo = yield from _batch_read_once(cfg, keys, mvs, todo, r,
                                               read_deadline(sent, r.lease_s), sizes)
        finally:  # these reads are over: their leases end now
            rel = released([keys[i] for i in asked], r.lease_ids or [0] * len(asked))
            if rel is not None:
                yield rel
        if not todo:
            return sizes
    log.warning("batch get: %d keys left unread, each of their %d read leases ran out "
                "before a replica was read", len(todo), cfg.put_retries + 1)
    return sizes


def _batch_read_once(cfg: ClientConfig, keys: Sequence[str], mvs: list[memoryview],
                     todo: list[int], r: m.BatchReplicaList, deadline: float,
                     sizes: list[int]) -> Steps[list[int]]:
    """One transfer batch for ``todo`` (``r`` answers those keys in order) by ``deadline``,
    then the other replicas of keys that failed, one by one while the lease lasts; fills
    ``sizes``, returns the keys to ask for again (their lease ran out first). SSD-only keys
    being promoted are read with a single get, which waits for the promotion."""
    reqs, idx = [], []
    for i, code, size, sum_, reps, value in zip(todo, r.codes, r.sizes, r.checksums,
                                                r.replicas, r.values or [None] * len(todo),
                                                strict=True):
        if value is not None:  # the master holds it: the bytes came in the reply
            copy_in(keys[i], mvs[i], value)
            verify(cfg, keys[i], mvs[i], size, sum_)
            sizes[i] = size
        elif code == C.OK:
            reqs.append(read(mvs[i], keys[i], size, reps[0]))
            idx.append((i, size, sum_, reps))
        elif code == C.PROMOTING:  # SSD-only: a single get waits for the promotion
            sizes[i] = (yield from get_leased(cfg, keys[i], into(mvs[i])))[0]
    if not reqs:
        return []
    try:
        statuses = (yield Read(reqs, deadline)).requests
    except LeaseExpired:
        return [i for i, *_ in idx]
    again = []
    for (i, size, sum_, reps), rs in zip(idx, statuses, strict=True):
        if rs.status == TransferStatus.DONE:  # a mismatch raises `ChecksumError`
            verify(cfg, keys[i], mvs[i], size, sum_)
            sizes[i] = size
            continue
        try:
            if time.monotonic() >= deadline or not (yield from read_one(
                    cfg, keys[i], mvs[i], size, sum_, reps[1:], deadline)):
                again.append(i)  # the lease ran out: the node is not to blame
                continue
            sizes[i] = size
        except StoreError as e:
            log.warning("reading %s failed: %s", keys[i], e)
    return again


def batch_get(cfg: ClientConfig, keys: Sequence[str]) -> Steps[list[bytearray | None]]:
    """Values of many keys in new buffers, None where absent or unreadable."""
    sent = time.monotonic()
    reps = yield Call(m.BatchGetReplicas(keys=list(keys)))
    assert isinstance(reps, m.BatchReplicaList)
    promoted: dict[int, bytearray] = {}
    for i, code in enumerate(reps.codes):
        if code == C.PROMOTING:  # SSD-only: a single get waits for the promotion
            promoted[i] = value_of((yield from get_leased(cfg, keys[i], new_value)))
            reps.codes[i] = int(C.NOT_FOUND)
    bufs = [new_buffer(max(s, 1)) for s in reps.sizes]
    sizes = yield from _batch_read(cfg, keys, [memoryview(b) for b in bufs], (reps, sent))
    out: list[bytearray | None] = [b if s == len(b) else (b[:s] if s >= 0 else None)
                                   for b, s in zip(bufs, sizes, strict=True)]
    for i, v in promoted.items():
        out[i] = v
    return out
