"""A remove whose reply was lost (the master applied it, then its connection broke — e.g. a
failover) is resent; the resend finds the key gone. `MasterConnection.call_tracked` reports the
loss, and `StoreClient.remove` / `batch_remove` (sync and asyncio) take NOT_FOUND on a resent
request as the first try's success. A NOT_LEADER refusal is not a loss: a plain NOT_FOUND
still raises. The fake master speaks the real wire protocol over TCP."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from yuebing.protocol import decode, encode
from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.client.rpc import AsyncMasterConnection, MasterConnection, StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.store.wire import HEADER

C = m.Code


class WireMaster:
    """Answers every request with NOT_FOUND (per key for batch removes). ``drop`` requests are
    read and then left unanswered by closing the connection (applied, reply lost);
    ``not_leader`` requests are refused with NOT_LEADER naming this very address."""

    def __init__(self, drop: int = 0, not_leader: int = 0) -> None:
        self.drop, self.not_leader = drop, not_leader
        self.hangup = False  # close each connection after its reply (a master restarting idle)
        self.seen: list[m.Message] = []
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.srv.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            f = conn.makefile("rb")
            while head := f.read(HEADER.size):
                length, rid = HEADER.unpack(head)
                msg = decode(f.read(length))
                self.seen.append(msg)
                if self.drop:
                    self.drop -= 1
                    return  # closes: the reply is lost
                if self.not_leader:
                    self.not_leader -= 1
                    reply: m.Message = m.Err(code=C.NOT_LEADER, message="standby",
                                             leader=self.address)
                elif isinstance(msg, m.BatchRemove):
                    reply = m.Codes(codes=[int(C.NOT_FOUND)] * len(msg.keys))
                else:
                    reply = m.Err(code=C.NOT_FOUND, message="no such key")
                body = encode(reply)
                conn.sendall(HEADER.pack(len(body), rid) + body)
                if self.hangup:
                    return

    def close(self) -> None:
        self.srv.close()


def conn(master: WireMaster) -> MasterConnection:
    return MasterConnection([master.address], timeout_s=0.5, failover_s=5.0)


@pytest.mark.parametrize("drop,not_leader,resent", [(0, 0, False), (1, 0, True), (0, 1, False)])
def test_call_tracked_reports_a_lost_reply_only(drop, not_leader, resent):
    master = WireMaster(drop=drop, not_leader=not_leader)
    c = conn(master)
    with pytest.raises(StoreRpcError) as e:
        c.call_tracked(m.Remove(key="k", force=False))
    assert e.value.code == C.NOT_FOUND and e.value.resent is resent
    assert len(master.seen) == 1 + drop + not_leader
    reply, lost = c.call_tracked(m.BatchRemove(keys=["a"], force=False))
    assert lost is False and reply.codes == [C.NOT_FOUND]  # type: ignore[attr-defined]
    c.close()
    master.close()


def test_a_connection_closed_while_idle_is_not_a_lost_try():
    """The master closed the connection between two calls (it restarted, say): the next
    request never reached it, so it is sent on a new connection and not counted as resent."""
    master = WireMaster()
    master.hangup = True
    c = conn(master)
    for _ in range(2):
        with pytest.raises(StoreRpcError) as e:
            c.call_tracked(m.Remove(key="k", force=False))
        assert e.value.code == C.NOT_FOUND and e.value.resent is False
        time.sleep(0.05)  # the close has arrived
    assert len(master.seen) == 2
    c.close()
    master.close()


def test_async_a_connection_closed_while_idle_is_not_a_lost_try():
    """As above for `AsyncMasterConnection`, which also must not wait out ``timeout_s`` for a
    reply on a connection its reader saw closed."""
    async def run() -> None:
        master = WireMaster()
        master.hangup = True
        c = AsyncMasterConnection([master.address], timeout_s=2.0, failover_s=5.0)
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(StoreRpcError) as e:
                await c.call_tracked(m.Remove(key="k", force=False))
            assert e.value.code == C.NOT_FOUND and e.value.resent is False
            assert time.monotonic() - t0 < 1.0
            await asyncio.sleep(0.05)
        assert len(master.seen) == 2
        c.close()
        master.close()

    asyncio.run(run())


def client(master: WireMaster) -> StoreClient:
    c = StoreClient(ClientConfig(direct=False), heartbeat=False)
    c.rpc.close()
    c.rpc = conn(master)
    return c


def test_resent_remove_that_finds_the_key_gone_succeeded():
    master = WireMaster(drop=1)
    c = client(master)
    c.remove("k")  # no NOT_FOUND: the lost first try removed it
    master.drop = 1
    assert c.batch_remove(["a", "b"]) == [C.OK, C.OK]
    with pytest.raises(StoreRpcError, match="NOT_FOUND"):
        c.remove("k")  # not resent: the key really is absent
    assert c.batch_remove(["a"]) == [C.NOT_FOUND]
    master.not_leader = 1  # refused, not lost: still NOT_FOUND
    with pytest.raises(StoreRpcError, match="NOT_FOUND"):
        c.remove("k")
    c.close()
    master.close()


def test_async_resent_remove_that_finds_the_key_gone_succeeded():
    async def run() -> None:
        master = WireMaster(drop=1)
        c = AsyncStoreClient(ClientConfig(direct=False))
        c.rpc = AsyncMasterConnection([master.address], timeout_s=0.5, failover_s=5.0)
        await c.remove("k")
        master.drop = 1
        assert await c.batch_remove(["a", "b"]) == [C.OK, C.OK]
        with pytest.raises(StoreRpcError, match="NOT_FOUND"):
            await c.remove("k")
        master.not_leader = 1
        assert await c.batch_remove(["a"]) == [C.NOT_FOUND]
        await c.close()
        master.close()

    asyncio.run(run())
