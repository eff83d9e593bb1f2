"""Reserve-ahead puts of the asyncio client under concurrency (`AsyncStoreClient`, no
sockets): many coroutines put values of one shape at once through a fake master that, like the
real one, answers a `PutStart` with the reservation of the shape it has — also one another
coroutine is writing into or just committed — and replies after random delays. Each
reservation must be written by exactly one put, and no committed value ever written over."""

from __future__ import annotations

import asyncio
import random

from yuebing.store import messages as m
from yuebing.store.client.aio import AsyncStoreClient
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, TransferStatus
from yuebing.transfer.types import RequestStatus

SIZE = 4096
SEG = "n/dram"


class RacyMaster:
    """One segment, a bump allocator; one reservation per (client, shape) like `reserve.py`.
    Records the offsets of committed values, the commits and the revokes."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_off = 0
        self.resv: dict[str, int] = {}  # pending reservation key -> offset (one at a time)
        self.current: str | None = None
        self.pending: dict[str, int] = {}
        self.committed: dict[int, str] = {}  # offset -> key
        self.calls: list[str] = []
        self.n = 0

    def _alloc(self) -> int:
        self.next_off += SIZE
        return self.next_off - SIZE

    def _reservation(self) -> m.Reservation:
        if self.current is None:
            self.n += 1
            self.current = f"{m.RESERVED_PREFIX}c/{self.n}"
            self.resv[self.current] = self._alloc()
        return m.Reservation(key=self.current, expires_in_s=30.0,
                             replicas=[m.Replica(segment=SEG, offset=self.resv[self.current])])

    def _handle(self, msg: m.Message) -> m.Message:
        if isinstance(msg, m.PutStart):
            off = self.pending[msg.item.key] = self._alloc()
            return m.PutTargets(key=msg.item.key, replicas=[m.Replica(segment=SEG, offset=off)],
                                expires_in_s=30.0,
                                reservation=self._reservation() if msg.reserve_next else None)
        if isinstance(msg, m.PutEnd):
            self.committed[self.pending.pop(msg.key)] = msg.key
            return m.Ok()
        if isinstance(msg, m.PutCommit):
            off = self.resv.pop(msg.reservation, None)
            if off is None:
                raise StoreRpcError(m.Code.NOT_PENDING, f"no reservation {msg.reservation}")
            self.current = None
            self.committed[off] = msg.item.key
            return m.PutCommitted(reservation=self._reservation() if msg.reserve_next else None)
        assert isinstance(msg, m.BatchPutRevoke), msg
        for k in msg.keys:
            self.resv.pop(k, None)
            self.current = None if self.current == k else self.current
        return m.Ok()

    async def call(self, msg: m.Message) -> m.Message:
        await asyncio.sleep(self.rng.uniform(0, 0.002))  # the request on its way
        self.calls.append(type(msg).__name__)
        reply = self._handle(msg)
        await asyncio.sleep(self.rng.uniform(0, 0.002))  # the reply on its way
        return reply

    def close(self) -> None:
        pass


class RecordingEngine:
    """Writes land after a random delay; each records its offset, and whether a committed
    value was there already."""

    def __init__(self, master: RacyMaster) -> None:
        self.master = master
        self.writes: list[int] = []
        self.overwrote: list[str] = []
        self._batches: dict[int, list] = {}

    def submit(self, reqs: list, timeout: float, inline: bool = False) -> int:
        self._batches[len(self._batches)] = reqs
        return len(self._batches) - 1

    async def wait_async(self, bid: int) -> BatchStatus:
        reqs = self._batches[bid]
        await asyncio.sleep(self.master.rng.uniform(0, 0.002))
        for r in reqs:
            self.writes.append(r.offset)
            if r.offset in self.master.committed:
                self.overwrote.append(self.master.committed[r.offset])
        done = tuple(RequestStatus(TransferStatus.DONE, r.length, r.length) for r in reqs)
        return BatchStatus(bid, TransferStatus.DONE, done)

    def free(self, bid: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_concurrent_same_shaped_puts_never_share_a_reservation() -> None:
    async def run(seed: int) -> tuple[RacyMaster, RecordingEngine]:
        master = RacyMaster(seed)
        engine = RecordingEngine(master)
        c = AsyncStoreClient(ClientConfig(direct=False, checksum=False), engine=engine)  # type: ignore[arg-type]
        c.rpc = master  # type: ignore[assignment]
        for wave in range(4):
            keys = [f"w{wave}/{i}" for i in range(12)]
            assert await c.batch_put(keys, [b"x" * SIZE] * len(keys)) == [0] * len(keys)
        await c.close()
        return master, engine

    for seed in range(20):
        master, engine = asyncio.run(run(seed))
        assert engine.overwrote == [], f"seed {seed}: committed values written over"
        assert len(engine.writes) == len(set(engine.writes)), f"seed {seed}: a range written twice"
        assert len(master.committed) == 48 and "PutCommit" in master.calls
        assert master.calls.count("PutCommit") + master.calls.count("PutEnd") == 48
        assert not master.resv  # close() gave the held one back


def test_one_put_at_a_time_costs_one_rpc_after_the_second() -> None:
    async def run() -> list[str]:
        master = RacyMaster(0)
        c = AsyncStoreClient(ClientConfig(direct=False), engine=RecordingEngine(master))  # type: ignore[arg-type]
        c.rpc = master  # type: ignore[assignment]
        for i in range(5):
            await c.put(f"k{i}", bytes([i]) * SIZE)
        await c.close()
        return master.calls

    assert asyncio.run(run()) == ["PutStart", "PutEnd"] * 2 + ["PutCommit"] * 3 + ["BatchPutRevoke"]
