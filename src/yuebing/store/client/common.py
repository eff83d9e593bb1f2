"""Logic shared by the sync and asyncio store clients: request building, replica choice,
checksums and per-key result handling. No I/O here."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.store import messages as m
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, OpCode, TransferRequest, TransferStatus
from yuebing.transfer.transport.shm import EXPIRED_WRITE
from yuebing.transfer.types import as_buffer

C = m.Code
BufferFor = Callable[[int], memoryview]
"""Where a get reads a value of the given size (the caller's buffer or a new one)."""


class ChecksumError(StoreError):
    """A value read back does not match the checksum stored with it."""


class NotFoundError(StoreError, KeyError):
    """No committed value under the key."""


def checksum(buf: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def view(value: object, writable: bool) -> memoryview:
    return as_buffer(value, writable=writable)


def put_item(cfg: ClientConfig, key: str, mv: memoryview, replicas: int | None,
             strategy: str | None, preferred: Sequence[str] | None, hard_pin: bool,
             soft_pin_s: float, best_effort: bool = False) -> m.PutItem:
    """The `PutItem` of a put; ``best_effort``: the master may place fewer than ``replicas``
    copies (at least one) instead of refusing the put."""
    if not isinstance(key, str) or not key:
        raise InputError(f"key must be a non-empty str, got {key!r}")
    if key.startswith(m.RESERVED_PREFIX):
        raise InputError(f"key {key!r}: keys starting with {m.RESERVED_PREFIX!r} are reserved "
                         "for the store's own reservations")
    if mv.nbytes == 0:
        raise InputError(f"value of {key!r} is empty; the store keeps values of >= 1 byte")
    pref = list(preferred) if preferred is not None else list(cfg.preferred)
    strat = strategy if strategy is not None else cfg.placement
    if not strat and cfg.local_segment:
        strat, pref = "preferred", [cfg.local_segment, *pref]
    return m.PutItem(key=key, size=mv.nbytes, checksum=checksum(mv) if cfg.checksum else -1,
                     replicas=replicas or cfg.replicas, strategy=strat, preferred=pref,
                     hard_pin=hard_pin, soft_pin_s=soft_pin_s, timeout_s=cfg.transfer_timeout_s,
                     min_replicas=1 if best_effort else 0)


def write_deadline(sent_at: float, expires_in_s: float) -> float:
    """A put's write deadline on this process's monotonic clock: the master's expiry (seconds
    from its reply) counted from ``sent_at``, when the request left (before the master's now:
    conservative whatever the network delay)."""
    return sent_at + expires_in_s


class WriteExpired(TransferError):
    """A put's write expiry passed before its transfer could start: this client was late."""


class LeaseExpired(TransferError):
    """A get's read lease (less `lease_margin`) ended before its read could start: the client
    must ask for the replicas again, not read ranges that may hold another value by now."""


class ReadLeaseExpired(StoreError):
    """Every read lease a get was granted (``put_retries + 1`` of them) ran out before one of
    its replicas could be read: the reads were too slow; no stale bytes were returned."""


LEASE_MARGIN_S = 0.05
"""Least safety margin kept before a read lease ends (clock rates, the reply's own delay)."""


def lease_margin(lease_s: float) -> float:
    """Seconds of a ``lease_s`` lease no read may use: 10 % of it or `LEASE_MARGIN_S`,
    whichever is larger, but at most half the lease (so a tiny lease still leaves time)."""
    return min(max(0.1 * lease_s, LEASE_MARGIN_S), lease_s / 2)


def read_deadline(sent_at: float, lease_s: float) -> float:
    """A get's read deadline on this process's monotonic clock: the master's lease (seconds
    from its reply) counted from ``sent_at``, before the request left (conservative, like
    `write_deadline`), less `lease_margin`. No read transfer starts or runs past it. A lease
    of 0 (the master grants none) bounds nothing: ``inf``."""
    if lease_s <= 0:
        return float("inf")
    return sent_at + lease_s - lease_margin(lease_s)


def released(keys: Sequence[str], ids: Sequence[int]) -> tuple[list[str], list[int]] | None:
    """The (keys, lease ids) a get releases once its reads of ``keys`` under leases ``ids``
    are over (done, failed or cut by the read deadline): those without a lease (id 0) left
    out; None when none is left. The master ends each lease its last reader released."""
    if len(keys) == 1:  # a single get: no lists to build
        return (list(keys), list(ids)) if ids[0] else None
    held = [(k, i) for k, i in zip(keys, ids, strict=True) if i]
    if not held:
        return None
    return [k for k, _ in held], [i for _, i in held]


def transfer_timeout(cfg: ClientConfig, deadline: float | None, read: bool = False) -> float:
    """Seconds a transfer batch may take: ``transfer_timeout_s``, cut to a put's write
    ``deadline`` (or a get's read deadline with ``read``); `WriteExpired` (the put must be
    revoked) or `LeaseExpired` (the get must ask again) if that passed already."""
    timeout = cfg.transfer_timeout_s
    if deadline is not None:
        timeout = min(timeout, deadline - time.monotonic())
        if timeout <= 0 and read:
            raise LeaseExpired(f"the read lease ended {-timeout:.3f}s before the read could "
                               "start")
        if timeout <= 0:
            raise WriteExpired(f"the put's write expiry passed {-timeout:.3f}s before its "
                               "transfer could start")
    return timeout


def writes(mv: memoryview, replicas: list[m.Replica]) -> list[TransferRequest]:
    return [TransferRequest(OpCode.WRITE, mv, r.segment, r.offset, mv.nbytes) for r in replicas]


def failed_segments(reqs: Sequence[TransferRequest], statuses: Sequence[Any] | None) -> list[str]:
    """Names of the segments whose request did not finish (all of them without statuses)."""
    if statuses is None:
        return sorted({str(r.segment) for r in reqs})
    return sorted({str(r.segment) for r, st in zip(reqs, statuses, strict=True)
                   if st.status != TransferStatus.DONE})


def blamed_segments(reqs: Sequence[TransferRequest], statuses: Sequence[Any] | None,
                    error: Exception | None = None) -> list[str]:
    """The failed segments to name in a revoke (the master stops placing there until their
    node heartbeats again): not when the put's own write expiry cut the write — before it
    started (`WriteExpired` as ``error``) or a same-host copy mid-way (`EXPIRED_WRITE`): the
    client was late, the node is fine."""
    if isinstance(error, WriteExpired):
        return []
    if statuses is None:
        return failed_segments(reqs, None)
    return sorted({str(r.segment) for r, st in zip(reqs, statuses, strict=True)
                   if st.status != TransferStatus.DONE and not (
                       st.status == TransferStatus.TIMEOUT and st.error.startswith(EXPIRED_WRITE))})


def write_outcome(reqs: Sequence[TransferRequest],
                  result: BatchStatus | Exception) -> tuple[list[str], list[str], str]:
    """A put's write to its replicas, judged: (segments that failed, those of them to blame
    in the revoke — `blamed_segments` —, why) from the transfer's status, or from the
    `TransferError`/`InputError` it raised. Used by both clients' single puts (`_write`) and
    the batch put's write into reservations (`batchput`)."""
    if isinstance(result, Exception):
        return failed_segments(reqs, None), blamed_segments(reqs, None, result), str(result)
    return (failed_segments(reqs, result.requests), blamed_segments(reqs, result.requests),
            "; ".join(result.errors))


BatchRead = tuple[int, int, int, list[m.Replica]]
"""One key of a batch read: (index, size, checksum, replicas)."""


def batch_reads(keys: Sequence[str], mvs: list[memoryview], todo: list[int],
                r: m.BatchReplicaList) -> tuple[list[TransferRequest], list[BatchRead], list[int]]:
    """Split a `BatchReplicaList` answering ``todo``: the first-replica reads of the keys found,
    their (index, size, checksum, replicas), and the indexes of SSD-only keys being promoted
    (read one by one with a single get). Shared by the sync and asyncio batch reads."""
    reqs, idx, promoting = [], [], []
    for i, code, size, sum_, reps in zip(todo, r.codes, r.sizes, r.checksums, r.replicas,
                                         strict=True):
        if code == m.Code.OK:
            reqs.append(read(mvs[i], keys[i], size, reps[0]))
            idx.append((i, size, sum_, reps))
        elif code == m.Code.PROMOTING:
            promoting.append(i)
    return reqs, idx, promoting


def batch_values(bufs: Sequence[bytearray], sizes: Sequence[int]) -> list[bytearray | None]:
    """What a bytes-returning batch get answers: each buffer cut to its value's size, None
    where the key was absent or unread (size -1)."""
    return [b if s == len(b) else (b[:s] if s >= 0 else None)
            for b, s in zip(bufs, sizes, strict=True)]


def read(buf: memoryview, key: str, size: int, rep: m.Replica) -> TransferRequest:
    if buf.nbytes < size:
        raise InputError(f"buffer of {buf.nbytes} bytes is too small for {key!r} ({size} bytes)")
    return TransferRequest(OpCode.READ, buf, rep.segment, rep.offset, size)


def verify(cfg: ClientConfig, key: str, buf: memoryview, size: int, expect: int) -> None:
    if cfg.checksum and expect >= 0:
        got = checksum(buf[:size])
        if got != expect:
            raise ChecksumError(f"checksum mismatch reading {key!r}: stored {expect:#x}, "
                                f"read {got:#x} (corrupted replica)")


def raise_code(code: int, key: str) -> None:
    if code == C.NOT_FOUND:
        raise NotFoundError(f"no value for {key!r}")
    raise StoreError(f"{C(code).name} for {key!r}")
