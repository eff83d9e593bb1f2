"""The store client's runners (`core.run` for the blocking client, `core.drive` for the asyncio
one) perform the same operations with the same error rules, on fake master connections and
transfers (no processes): a master's refusal and a failed read are thrown into the steps, a
failed write comes back as its reply, a failed revoke is logged and forgotten, a lease release
is queued; a cancelled asyncio get still releases its read lease."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from yuebing.core.errors import InputError, StoreError, TransferError
from yuebing.protocol import store as m
from yuebing.store.client import core, gets
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferStatus
from yuebing.transfer.types import BatchId, RequestStatus

DONE = BatchStatus(BatchId(1), TransferStatus.DONE, (RequestStatus(TransferStatus.DONE, 4, 4),))


class Rpc:
    """A master connection answering from ``replies`` (an exception there is raised)."""

    def __init__(self, replies: dict[type, Any]) -> None:
        self.replies = replies
        self.sent: list[str] = []
        self.released: list[tuple[list[str], list[int]]] = []

    def call(self, msg: m.Message) -> Any:
        self.sent.append(type(msg).__name__)
        got = self.replies[type(msg)]
        if isinstance(got, BaseException):
            raise got
        return got

    def call_tracked(self, msg: m.Message) -> tuple[Any, bool]:
        return self.call(msg), True

    def release(self, keys: list[str], ids: list[int]) -> None:
        self.released.append((keys, ids))


class SyncIo:
    client_id = "c"

    def __init__(self, rpc: Rpc, transfer: Any) -> None:
        self.rpc, self._transfer = rpc, transfer

    def transfer(self, reqs: list, deadline: float, read: bool) -> Any:
        if isinstance(self._transfer, BaseException):
            raise self._transfer
        return self._transfer


class AsyncRpc(Rpc):
    async def call(self, msg: m.Message) -> Any:  # type: ignore[override]
        return super().call(msg)

    async def call_tracked(self, msg: m.Message) -> tuple[Any, bool]:  # type: ignore[override]
        return await self.call(msg), True


class AsyncIo(SyncIo):
    async def transfer(self, reqs: list, deadline: float, read: bool) -> Any:  # type: ignore[override]
        return super().transfer(reqs, deadline, read)


def script() -> core.Steps[list[object]]:
    """Each kind of operation once, failing; what the steps got back."""
    got: list[object] = []
    try:
        yield core.Call(m.Exists(key="k"))
    except StoreRpcError as e:
        got.append(("thrown", e.code))
    got.append(("reply", type((yield core.Write([], 1.0))).__name__))
    got.append(("reply", (yield core.Revoke(["k"], []))))
    try:
        yield core.Read([], 1.0)
    except TransferError as e:
        got.append(("thrown", str(e)))
    got.append(("reply", (yield core.Release(["k"], [3]))))
    got.append(("tracked", (yield core.Call(m.BatchRemove(keys=["k"]), tracked=True))[1]))
    return got


REPLIES = {m.Exists: StoreRpcError(int(m.Code.NOT_FOUND), "no"),
           m.BatchPutRevoke: StoreError("master gone"), m.BatchRemove: m.Codes(codes=[0])}
EXPECTED = [("thrown", m.Code.NOT_FOUND), ("reply", "TransferError"), ("reply", None),
            ("thrown", "engine closed"), ("reply", None), ("tracked", True)]


def test_run_and_drive_give_the_steps_the_same_results() -> None:
    sync = SyncIo(Rpc(REPLIES), TransferError("engine closed"))
    assert core.run(script(), sync) == EXPECTED
    aio = AsyncIo(AsyncRpc(REPLIES), TransferError("engine closed"))
    assert asyncio.run(core.drive(script(), aio)) == EXPECTED
    assert sync.rpc.sent == aio.rpc.sent == ["Exists", "BatchPutRevoke", "BatchRemove"]
    assert sync.rpc.released == aio.rpc.released == [(["k"], [3])]


def test_an_error_the_steps_do_not_handle_reaches_the_caller_after_their_cleanup() -> None:
    reps = m.ReplicaList(key="k", size=4, checksum=-1, lease_s=5.0, lease_id=9,
                         replicas=[m.Replica(segment="s", offset=0)])
    io = SyncIo(Rpc({m.GetReplicas: reps}), DONE)
    with pytest.raises(InputError, match="too small"):
        core.run(gets.get_leased(ClientConfig(), "k", gets.into(bytearray(2))), io)
    assert io.rpc.released == [(["k"], [9])]  # the lease still ended
    buf = bytearray(4)
    assert core.run(gets.get_leased(ClientConfig(checksum=False), "k", gets.into(buf)),
                    io)[0] == 4


def test_a_cancelled_async_get_still_releases_its_read_lease() -> None:
    reps = m.ReplicaList(key="k", size=4, checksum=-1, lease_s=5.0, lease_id=9,
                         replicas=[m.Replica(segment="s", offset=0)])
    started = asyncio.Event()

    class Stalled(AsyncIo):
        async def transfer(self, reqs: list, deadline: float, read: bool) -> Any:  # type: ignore[override]
            started.set()
            await asyncio.sleep(60)  # a transfer that never ends

    io = Stalled(AsyncRpc({m.GetReplicas: reps}), DONE)

    async def main() -> None:
        task = asyncio.create_task(core.drive(gets.get_leased(
            ClientConfig(), "k", gets.new_value), io))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert io.rpc.released == [(["k"], [9])]
