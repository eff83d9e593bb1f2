"""The put side of both store clients, written once with no I/O: step generators that yield
`core`'s operations (`Call`, `Write`, `Revoke`) and are sent their results — `put` (one value)
and `BatchPut` (many) — plus the request building and write judging they share. Every decision
(codes per key, reservations, fallbacks, revokes, write deadlines) is made here; the clients
(`client`) only run the steps. A small value asks the master to hold it (one `PutInline`,
`inline`); else a put goes through a held reservation of its shape (one ``put_commit``, which
may ride on the write to the node: `core.Commit`) when there is one, else in two phases
(``put_start``, writes, ``put_end``); a failed write is revoked, blaming its segments, and placed
again up to ``put_retries`` times.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yuebing.core.errors import InputError, StoreError
from yuebing.protocol import store as m
from yuebing.store.client import core as cm
from yuebing.store.client import inline
from yuebing.store.client import reserve as rv
from yuebing.store.client.core import Call, Commit, Revoke, Steps, Write
from yuebing.store.client.direct import WriteExpired
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, OpCode, TransferRequest, TransferStatus
from yuebing.transfer.transport.shm import EXPIRED_WRITE

log = logging.getLogger(__name__)
C = m.Code


@dataclass(slots=True)
class PutOptions:
    """How a put places its values: the keywords of the clients' ``put`` / ``batch_put``
    (None: the `ClientConfig` default; ``best_effort``: the master may place fewer than
    ``replicas`` copies, at least one, instead of refusing the put). One per call, read only
    (not frozen: that would triple its cost on the put path)."""

    replicas: int | None = None
    strategy: str | None = None
    preferred: Sequence[str] | None = None
    hard_pin: bool = False
    soft_pin_s: float = 0.0
    best_effort: bool = False


def put_item(cfg: ClientConfig, key: str, mv: memoryview, opts: PutOptions) -> m.PutItem:
    """The `PutItem` of a put (`InputError` for a bad key or an empty value: nothing is sent
    then)."""
    if not isinstance(key, str) or not key:
        raise InputError(f"key must be a non-empty str, got {key!r}")
    if key.startswith(m.RESERVED_PREFIX):
        raise InputError(f"key {key!r}: keys starting with {m.RESERVED_PREFIX!r} are reserved "
                         "for the store's own reservations")
    if mv.nbytes == 0:
        raise InputError(f"value of {key!r} is empty; the store keeps values of >= 1 byte")
    pref = list(opts.preferred) if opts.preferred is not None else list(cfg.preferred)
    strat = opts.strategy if opts.strategy is not None else cfg.placement
    if not strat and cfg.local_segment:
        strat, pref = "preferred", [cfg.local_segment, *pref]
    return m.PutItem(key=key, size=mv.nbytes, checksum=cm.checksum(mv) if cfg.checksum else -1,
                     replicas=opts.replicas or cfg.replicas, strategy=strat, preferred=pref,
                     hard_pin=opts.hard_pin, soft_pin_s=opts.soft_pin_s,
                     timeout_s=cfg.transfer_timeout_s, min_replicas=1 if opts.best_effort else 0)


def write_deadline(sent_at: float, expires_in_s: float) -> float:
    """A put's write deadline on this process's monotonic clock: the master's expiry (seconds
    from its reply) counted from ``sent_at``, when the request left (before the master's now:
    conservative whatever the network delay)."""
    return sent_at + expires_in_s


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
    `TransferError`/`InputError` it raised."""
    if isinstance(result, Exception):
        return failed_segments(reqs, None), blamed_segments(reqs, None, result), str(result)
    return (failed_segments(reqs, result.requests), blamed_segments(reqs, result.requests),
            "; ".join(result.errors))


# ---------------------------------------------------------------- single put
def put(cfg: ClientConfig, client: str, resv: rv.HeldReservations, key: str, value: object,
        opts: PutOptions, gate: inline.InlineGate | None = None) -> Steps[int]:
    """Store ``value`` (any contiguous buffer) under ``key``; values are immutable. A small
    one (`inline.wants`; ``gate``: None = never) is held by the master if it takes it (one
    RPC; counts as one replica); else through
    the held reservation of its shape when there is one (`_put_reserved`), else in two
    phases: ``put_start``, the writes by the start's write deadline, ``put_end``; a write that
    fails is revoked (naming the blamed segments, which the master then avoids) and placed
    again up to ``put_retries`` times. Returns the number of replicas stored."""
    mv = cm.view(value, writable=False)
    item = put_item(cfg, key, mv, opts)  # one checksum, whichever way the value goes
    if gate is not None and inline.wants(cfg, gate, mv.nbytes, opts.replicas, opts.strategy,
                                         opts.preferred, opts.best_effort) and (
            yield from inline.put(client, gate, item, mv)):
        return 1
    shape = rv.shape_of(item) if cfg.reserve_ahead else None
    if shape is not None and (yield from _put_reserved(client, resv, item, mv, shape)):
        return item.replicas  # a reservation holds every replica of its shape
    reserve_next = shape is not None and resv.want(shape)
    for attempt in range(cfg.put_retries + 1):
        sent = time.monotonic()
        targets = yield Call(m.PutStart(client=client, item=item, reserve_next=reserve_next))
        assert isinstance(targets, m.PutTargets)
        if shape is not None:
            resv.keep(shape, targets.reservation, sent)
        reqs = writes(mv, targets.replicas)
        got = yield Write(reqs, write_deadline(sent, targets.expires_in_s))
        failed, blamed, why = write_outcome(reqs, got)
        if not failed:
            yield Call(m.PutEnd(client=client, key=key))
            return len(targets.replicas)
        yield Revoke([key], blamed, resv.touching(failed))
        log.warning("put %s: write to %s failed (attempt %d): %s", key, failed, attempt + 1, why)
    raise StoreError(f"writing {key!r} failed; put revoked: {why}")


def _put_reserved(client: str, resv: rv.HeldReservations, item: m.PutItem, mv: memoryview,
                  shape: rv.Shape) -> Steps[bool]:
    """Put ``item`` through the held reservation of its shape: `claim` it (this put alone
    writes into it, and no later reply hands it out again), give back the stale ones of any
    shape that have not expired (past its write expiry the master reclaimed one itself), write
    into it, then one ``put_commit`` (which brings the next reservation). False when there is
    none usable or the write or commit failed (the caller then puts it in two phases); a
    refused commit `release`s the reservation (it stays the master's, empty). A failed write
    whose commit rode on it and was applied (the node landed the frame, reported it and died
    before its answer) is done: the revoke answers COMMITTED."""
    now = time.monotonic()
    stale = resv.drop_stale(now)
    held, one = resv.claim(shape, now)
    if one is not None:
        stale.append(one)
    if stale:  # too little write time left: give them back unused
        yield Revoke([], [], stale)
    if held is None:
        return False
    reqs = writes(mv, held.replicas)
    commit = m.PutCommit(client=client, reservation=held.key, item=item, reserve_next=True)
    sent = time.monotonic()  # the commit may leave with the write
    failed, blamed, why = write_outcome(reqs, (yield Write(
        reqs, held.deadline, commit if len(reqs) == 1 else None)))
    if failed:
        try:
            got = yield Revoke([held.key], blamed, resv.touching(failed), landing=True)
        except StoreError as e:  # the node may have landed it, commit and all: no EXISTS
            raise StoreError(  # from a put again, the truth instead
                f"put {item.key!r}: the write into its reservation on {failed} failed ({why}) "
                f"and revoking it failed ({e}); the node may have landed the value with its "
                "commit, so whether it is stored is unknown") from e
        if isinstance(got, m.Codes) and got.codes[:1] == [C.COMMITTED]:
            log.info("put %s: the write into reservation on %s failed (%s) after it landed "
                     "and its commit was applied: stored", item.key, failed, why)
            yield from _landed_next(resv, shape, commit, sent, failed)
            return True
        log.warning("put %s: write into reservation on %s failed: %s", item.key, failed, why)
        return False
    try:
        r = yield Commit(commit)
    except StoreRpcError as e:
        resv.release(held.key)
        log.info("put %s: reservation refused (%s); putting it in two phases", item.key, e)
        return False
    assert isinstance(r, m.PutCommitted)
    resv.keep(shape, r.reservation, sent)
    return True


def _landed_next(resv: rv.HeldReservations, shape: rv.Shape, commit: m.PutCommit, sent: float,
                 failed: list[str]) -> Steps[None]:
    """After a revoke answered COMMITTED: the next reservation that the landed ``commit``
    placed (its answer, taken while revoking, or ``commit`` resent — answered OK, the
    reservation consumed, nothing new committed) is held, or given back when it lies on a
    segment of ``failed``; never left to wait out its write expiry unknown to the client. A
    failure here leaves it to that expiry: the put is done either way."""
    try:
        r = yield Commit(commit)
    except StoreError as e:
        log.info("put %s: the landed commit's next reservation not fetched: %s",
                 commit.item.key, e)
        return
    if isinstance(r, m.PutCommitted) and r.reservation is not None:
        resv.keep(shape, r.reservation, sent)
        bad = resv.touching(failed)
        if bad:
            yield Revoke([], [], bad)


def give_back(keys: list[str]) -> Steps[None]:
    """Give back the held reservations ``keys`` unused (a client closing)."""
    yield Revoke([], [], keys)


# ---------------------------------------------------------------- batch put
def items_of(cfg: ClientConfig, keys: Sequence[str], values: Sequence[object],
             opts: PutOptions) -> tuple[list[m.PutItem], list[memoryview]]:
    """The `PutItem`s and read-only views of a batch put's ``keys`` and ``values``
    (`InputError` on a count mismatch, a bad key or an empty value: nothing is sent then)."""
    if len(keys) != len(values):
        raise InputError(f"{len(keys)} keys but {len(values)} values")
    mvs = [cm.view(v, writable=False) for v in values]
    return [put_item(cfg, k, mv, opts) for k, mv in zip(keys, mvs, strict=True)], mvs


class BatchPut:
    """One batch put of a client (`steps` is the generator; see the module docstring).

    Items of one shape, at most `rv.MAX_PER_SHAPE`. With as many usable reservations of the shape
    held, every item is written into one (one transfer batch, by the earliest write deadline) and
    one ``batch_put_commit`` commits each item and hands out the next batch's; a failed write
    revokes those reservations, a refused commit or item falls back. Otherwise — or for what fell
    back — two phases: one ``batch_put_start`` (plus ``reserve_next`` = n from the shape's second
    batch on), one transfer batch, a revoke of the failed items, one ``batch_put_end``.

    Reservations are claimed synchronously (`claim_many`: no await between taking and marking
    busy), so each is written by exactly one put, concurrent coroutines included, and no reply in
    flight hands a claimed one out again. One whose commit was refused holds nothing: it is
    released before the reply's reservations are kept. Stale ones are given back (``unused``) only
    before their write expiry; past it the master reclaimed them."""

    def __init__(self, cfg: ClientConfig, client: str, resv: rv.HeldReservations,
                 keys: Sequence[str], values: Sequence[object], opts: PutOptions,
                 gate: inline.InlineGate | None = None) -> None:
        self.cfg, self.client, self.resv = cfg, client, resv
        self.items, self.mvs = items_of(cfg, keys, values, opts)
        self.gate = gate if all(inline.wants(
            cfg, gate, mv.nbytes, opts.replicas, opts.strategy, opts.preferred,
            opts.best_effort) for mv in self.mvs) and inline.batch_fits(
                sum(mv.nbytes for mv in self.mvs), len(self.mvs)) else None
        """Set when every value of the batch may ask the master to hold it."""
        self.codes = [int(C.INTERNAL)] * len(self.items)
        """A `Code` per item: what the caller gets back."""

    def steps(self) -> Steps[list[int]]:
        """The whole batch put; returns a `Code` per item (small values first ask the master
        to hold them, all with one `BatchPutInline`)."""
        todo = list(range(len(self.items)))
        if self.gate is not None:
            todo = yield from inline.batch_put(self.client, self.gate, self.items, self.mvs,
                                               todo, self.codes)
        for _ in range(self.cfg.put_retries + 1):
            if not todo:
                break
            todo = yield from self._once(todo)
        return self.codes

    def _shape(self, todo: list[int]) -> rv.Shape | None:
        """The shape of the items ``todo`` when they may go through reservations."""
        first = rv.shape_of(self.items[todo[0]])
        return first if self.cfg.reserve_ahead and len(todo) <= rv.MAX_PER_SHAPE and all(
            rv.shape_of(self.items[i]) == first for i in todo[1:]) else None

    def _once(self, todo: list[int]) -> Steps[list[int]]:
        """One attempt for the items ``todo``; fills ``codes``, returns those to retry. Items
        of one shape go through held reservations when there are enough (`_reserved`) and ask
        for the next batch's; the rest are put in two phases."""
        items, codes = self.items, self.codes
        shape = self._shape(todo)
        if shape is not None:
            todo = yield from self._reserved(todo, shape)
            if not todo:
                return []
        sent = time.monotonic()
        reserve_next = len(todo) if shape is not None and self.resv.want(shape) else 0
        r = yield Call(m.BatchPutStart(client=self.client, items=[items[i] for i in todo],
                                       reserve_next=reserve_next))
        assert isinstance(r, m.BatchPutTargets)
        if shape is not None:
            self.resv.keep_many(shape, r.reservations, sent)
        reqs, owner = [], []
        for i, code, reps in zip(todo, r.codes, r.replicas, strict=True):
            codes[i] = code
            if code == C.OK:
                for req in writes(self.mvs[i], reps):
                    reqs.append(req)
                    owner.append(i)
        failed: set[int] = set()
        bad: list[str] = []
        if reqs:
            got = yield Write(reqs, write_deadline(sent, r.expires_in_s))
            if isinstance(got, BatchStatus):
                failed = {owner[j] for j, rs in enumerate(got.requests)
                          if rs.status != TransferStatus.DONE}
                bad = blamed_segments(reqs, got.requests)
            else:
                log.warning("batch put transfer failed: %s", got)
                failed, bad = set(owner), blamed_segments(reqs, None, got)
        ok = [i for i in todo if codes[i] == C.OK and i not in failed]
        if failed:
            yield Revoke([items[i].key for i in sorted(failed)], bad)
            for i in failed:
                codes[i] = int(C.INTERNAL)
        if ok:
            ends = yield Call(m.BatchPutEnd(client=self.client, keys=[items[i].key for i in ok]))
            for i, c in zip(ok, ends.codes, strict=True):
                codes[i] = c
        return sorted(failed)

    def _take(self, shape: rv.Shape, n: int) -> tuple[list[rv.Held], list[str]]:
        """``n`` held reservations of ``shape`` for this batch alone (or none) and the keys
        of stale ones to give back now (`claim_many`)."""
        now = time.monotonic()
        held, stale = self.resv.claim_many(shape, n, now)
        return held, [h.key for h in stale if h.deadline > now]  # past it, the master did

    def _reserved(self, todo: list[int], shape: rv.Shape) -> Steps[list[int]]:
        """Put the items ``todo`` (one shape) through as many held reservations: one write, one
        ``batch_put_commit`` (which brings the next batch's). Fills ``codes`` of the items it
        stored (or found existing); returns the items left to the two-phase way — all of them
        when too few reservations are held or the write or commit failed."""
        held, stale = self._take(shape, len(todo))
        if stale:  # give back what the master holds: never written, freed at once
            yield Revoke([], [], stale)
        if not held:
            return todo
        reqs = [req for i, h in zip(todo, held, strict=True)
                for req in writes(self.mvs[i], h.replicas)]
        got = yield Write(reqs, min(h.deadline for h in held))
        failed, bad, why = write_outcome(reqs, got)
        if failed:
            yield Revoke([h.key for h in held], bad, self.resv.touching(failed))
            log.warning("batch put: write into reservations on %s failed: %s", failed, why)
            return todo
        sent = time.monotonic()
        try:
            r = yield Call(m.BatchPutCommit(
                client=self.client, reservations=[h.key for h in held],
                items=[self.items[i] for i in todo], reserve_next=len(todo)))
        except StoreRpcError as e:
            self._release(held)
            log.info("batch put: reservations refused (%s); putting it in two phases", e)
            return todo
        assert isinstance(r, m.BatchPutCommitted)
        self._release([h for h, code in zip(held, r.codes, strict=True) if code != C.OK])
        self.resv.keep_many(shape, r.reservations, sent)
        left = []
        for i, code in zip(todo, r.codes, strict=True):
            if code in (C.OK, C.EXISTS):
                self.codes[i] = code
            else:  # its reservation refused it (and stays the master's): two phases
                left.append(i)
        return left

    def _release(self, held: list[rv.Held]) -> None:
        """Claimed reservations nothing was committed into (they stay the master's)."""
        for h in held:
            self.resv.release(h.key)

