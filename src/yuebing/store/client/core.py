"""The sans-IO core of both store clients: the operations a protocol step needs (`Call` the
master, `Write` or `Read` a transfer batch, `Revoke` puts, `Release` read leases), the
runners that perform them on a client (`drive` awaiting, `run` blocking; one set of rules:
`_perform`, `_failed`), the helpers both sides share (`checksum`, `view`) and the removes.
The steps are step generators: the read side is `gets`, the put side `puts`. No I/O here:
`StoreClient` and `AsyncStoreClient` (`client`) only perform the operations a generator yields
and send back their results, so the two cannot drift.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from types import CoroutineType
from typing import Any, Protocol, TypeVar

import xxhash

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.protocol import store as m
from yuebing.store.client.rpc import StoreRpcError, removed_codes
from yuebing.transfer import TransferRequest
from yuebing.transfer.types import as_buffer

log = logging.getLogger(__name__)
C = m.Code
T = TypeVar("T")


# ---------------------------------------------------------------- operations and runners
# (not frozen: a frozen dataclass costs ~3x as much to build, and a get builds three)
@dataclass(slots=True)
class Call:
    """Send ``msg`` to the master; the reply is sent back (with ``tracked``: the pair (reply,
    whether the request had to be resent), `call_tracked`), a `StoreError` thrown in."""

    msg: m.Message
    tracked: bool = False


@dataclass(slots=True)
class Write:
    """Transfer the writes ``reqs`` by the monotonic ``deadline``; sent back: the
    `BatchStatus`, or the `TransferError`/`InputError` the transfer raised (not thrown).
    ``commit``: the put's commit, which may ride on the write frame to a node on another host
    (`m.LandingCommit`; `Commit` then takes the master's answer to it)."""

    reqs: list[TransferRequest]
    deadline: float
    commit: m.PutCommit | None = None


@dataclass(slots=True)
class Commit:
    """The commit ``msg`` of the put just written with it (`Write.commit`): the master's answer
    to the commit that landed with the write when one comes soon, else ``msg`` sent now — the
    same reply either way (a commit the node handed on already is answered OK again)."""

    msg: m.PutCommit


@dataclass(slots=True)
class Read:
    """Transfer the reads ``reqs`` by the read-lease ``deadline``; sent back: the
    `BatchStatus`; a `TransferError` (`LeaseExpired` if it passed already) is thrown in."""

    reqs: list[TransferRequest]
    deadline: float


@dataclass(slots=True)
class Revoke:
    """``batch_put_revoke`` of ``keys`` naming ``failed`` segments, giving back the held
    reservations ``unused`` (never written: freed at once); the runner logs a failure (the
    master then reclaims them at their write expiry) and sends back None — unless ``landing``
    (the failed write carried its put's commit: `Write.commit`) and that commit rode on the
    frame (`Io.noted`): then the node may have landed it, and the failure is thrown in."""

    keys: list[str]
    failed: list[str]
    unused: list[str] = field(default_factory=list)
    landing: bool = False


@dataclass(slots=True)
class Release:
    """These reads are over: queue their lease releases (`MasterConnection.release`, carried
    by a later call, no I/O of its own); None is sent back."""

    keys: list[str]
    ids: list[int]


Op = Call | Write | Read | Revoke | Release | Commit
Steps = Generator[Op, Any, T]


class Io(Protocol):
    """What a client gives the runners (`StoreClient`, `AsyncStoreClient`): its master
    connection (``call``, ``call_tracked``, ``release``) and its transfer of a batch (same-host
    copies, then the engine; `LeaseExpired` / `WriteExpired` when the deadline passed). With
    the asyncio client, the calls and the transfer return awaitables."""

    client_id: str

    @property
    def rpc(self) -> Any: ...

    def transfer(self, reqs: list[TransferRequest], deadline: float, read: bool,
                 commit: m.PutCommit | None = None) -> Any: ...

    def commit(self, msg: m.PutCommit) -> Any: ...

    @property
    def noted(self) -> bool:
        """Whether the last write's commit rode on its frame (a `Commit` then waits for the
        master's answer to it)."""
        ...


def _perform(io: Io, op: Op) -> Any:
    """Start ``op`` on ``io``: its result, or an awaitable of it (the asyncio client)."""
    if type(op) is Call:
        return io.rpc.call_tracked(op.msg) if op.tracked else io.rpc.call(op.msg)
    if type(op) is Write and op.commit is not None:
        return io.transfer(op.reqs, op.deadline, False, op.commit)
    if isinstance(op, Write | Read):
        return io.transfer(op.reqs, op.deadline, type(op) is Read)
    if type(op) is Commit:
        return io.commit(op.msg)
    if type(op) is Release:
        return io.rpc.release(op.keys, op.ids)
    assert isinstance(op, Revoke)
    return io.rpc.call(m.BatchPutRevoke(client=io.client_id, keys=op.keys, failed=op.failed,
                                        unused=op.unused))


def _failed(io: Io, op: Op, e: BaseException) -> tuple[Any, BaseException | None]:
    """What the steps get when ``op`` raised ``e``: (reply, error to throw in). A write's
    `TransferError`/`InputError` is its reply (`Write`); a failed revoke is logged (the master
    reclaims those puts as zombies later) unless it follows a write whose commit rode on it
    (`Revoke.landing`); anything else is thrown in."""
    if type(op) is Write and isinstance(e, TransferError | InputError):
        return e, None
    if type(op) is Revoke and isinstance(e, StoreError) and not (op.landing and io.noted):
        log.warning("revoking %d puts failed: %s", len(op.keys), e)
        return None, None
    return None, e


async def drive(steps: Steps[T], io: Io) -> T:
    """Run ``steps``, performing each operation on ``io`` and sending back its result (each
    exception is thrown in, a cancellation too, so the steps' lease releases still happen).
    The asyncio client awaits this (its calls and transfers return awaitables); the
    blocking one uses `run`."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value
        reply, error = None, None
        try:
            reply = _perform(io, op)
            if type(reply) is CoroutineType:
                reply = await reply
        except BaseException as e:  # noqa: BLE001 - the steps decide, and re-raise the rest
            reply, error = _failed(io, op, e)


def run(steps: Steps[T], io: Io) -> T:
    """`drive` for the blocking client, whose operations return their results: the same
    operations and exceptions, with no coroutine around them (a get runs three)."""
    send, throw = steps.send, steps.throw
    try:
        op = send(None)
        while True:
            try:
                reply = _perform(io, op)
            except BaseException as e:  # noqa: BLE001 - as in `drive`
                reply, error = _failed(io, op, e)
                if error is not None:
                    op = throw(error)
                    continue
            op = send(reply)
    except StopIteration as done:
        return done.value


def reply(msg: m.Message, kind: type[T]) -> T:
    """``msg``, a master's reply, as the ``kind`` the request is answered with."""
    assert isinstance(msg, kind), msg
    return msg


# ---------------------------------------------------------------- shared request helpers
def checksum(buf: memoryview) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def view(value: object, writable: bool) -> memoryview:
    return as_buffer(value, writable=writable)


# ---------------------------------------------------------------- probes and removal
def remove_failed(e: StoreRpcError) -> None:
    """A single remove's error ``e``, re-raised unless it is NOT_FOUND on a request that had to
    be resent (its first reply lost, e.g. at a failover): then the first try removed the key.
    A helper, not steps: a remove is one call, and both clients make it straight."""
    if not (e.code == C.NOT_FOUND and e.resent):
        raise e


def batch_remove(keys: Sequence[str], force: bool) -> Steps[list[int]]:
    """A `Code` per key (NOT_FOUND counts as OK when the request had to be resent)."""
    r, resent = yield Call(m.BatchRemove(keys=list(keys), force=force), tracked=True)
    assert isinstance(r, m.Codes)
    return removed_codes(r.codes, resent)
