"""Reserve-ahead puts of the asyncio client under concurrency (`AsyncStoreClient`, no
sockets): many coroutines put values of one shape at once through a fake master that, like the
real one, answers a `PutStart` with the reservation of the shape it has — also one another
coroutine is writing into or just committed — and replies after random delays. Each
reservation must be written by exactly one put, and no committed value ever written over;
concurrent batch puts the same (`claim_many`), and a stream of batches goes through
`BatchPutCommit`."""

from __future__ import annotations

import asyncio
import random

from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig as _ClientConfig
from yuebing.transfer import BatchStatus, SegmentDescriptor, TransferStatus
from yuebing.transfer.types import RequestStatus


def ClientConfig(**kw):  # noqa: N802  reservations are a segment path: values the master
    return _ClientConfig(inline_max_bytes=0, **kw)  # holds itself would bypass them

SIZE = 4096
SEG = "n/dram"


class RacyMaster:
    """One segment, a bump allocator; the client's reservations of its one shape in a list,
    oldest first, handed out like `reserve.reserve_many` (the ones held first — also one
    another coroutine is writing into — then new ones). Records the offsets of committed
    values, the calls, the reservation names each commit consumed and the offsets of those
    given back as never written (`BatchPutRevoke.unused`)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_off = 0
        self.resv: dict[str, int] = {}  # pending reservation key -> offset, oldest first
        self.pending: dict[str, int] = {}
        self.committed: dict[int, str] = {}  # offset -> key
        self.keys: set[str] = set()
        self.consumed: list[str] = []  # reservation names committed into
        self.unused: list[int] = []  # offsets of reservations given back as never written
        self.calls: list[str] = []
        self.n = 0

    def _alloc(self) -> int:
        self.next_off += SIZE
        return self.next_off - SIZE

    def _reservations(self, n: int) -> list[m.Reservation]:
        while len(self.resv) < n:
            self.n += 1
            self.resv[f"{m.RESERVED_PREFIX}c/{self.n}"] = self._alloc()
        return [m.Reservation(key=k, expires_in_s=30.0,
                              replicas=[m.Replica(segment=SEG, offset=self.resv[k])])
                for k in list(self.resv)[:n]]

    def _start(self, key: str) -> tuple[int, list[m.Replica]]:
        if key in self.keys or key in self.pending:
            return int(m.Code.EXISTS), []
        off = self.pending[key] = self._alloc()
        return int(m.Code.OK), [m.Replica(segment=SEG, offset=off)]

    def _end(self, key: str) -> int:
        self.committed[self.pending.pop(key)] = key
        self.keys.add(key)
        return int(m.Code.OK)

    def _commit(self, name: str, key: str) -> int:
        if name not in self.resv:
            return int(m.Code.NOT_PENDING)
        if key in self.keys or key in self.pending:
            return int(m.Code.EXISTS)  # its reservation stays
        self.committed[self.resv.pop(name)] = key
        self.keys.add(key)
        self.consumed.append(name)
        return int(m.Code.OK)

    def _handle(self, msg: m.Message) -> m.Message:
        if isinstance(msg, m.PutStart):
            code, reps = self._start(msg.item.key)
            if code:
                raise StoreRpcError(code, f"{msg.item.key} exists")
            return m.PutTargets(key=msg.item.key, replicas=reps, expires_in_s=30.0,
                                reservation=self._reservations(1)[0] if msg.reserve_next else None)
        if isinstance(msg, m.PutEnd):
            self._end(msg.key)
            return m.Ok()
        if isinstance(msg, m.PutCommit):
            code = self._commit(msg.reservation, msg.item.key)
            if code:
                raise StoreRpcError(code, f"commit into {msg.reservation} refused")
            return m.PutCommitted(reservation=self._reservations(1)[0] if msg.reserve_next else None)
        if isinstance(msg, m.BatchPutStart):
            got = [self._start(it.key) for it in msg.items]
            return m.BatchPutTargets(codes=[c for c, _ in got], replicas=[r for _, r in got],
                                     expires_in_s=30.0,
                                     reservations=self._reservations(msg.reserve_next))
        if isinstance(msg, m.BatchPutEnd):
            return m.Codes(codes=[self._end(k) for k in msg.keys])
        if isinstance(msg, m.BatchPutCommit):
            codes = [self._commit(r, it.key) for r, it in zip(msg.reservations, msg.items,
                                                                strict=True)]
            return m.BatchPutCommitted(codes=codes,
                                       reservations=self._reservations(msg.reserve_next))
        assert isinstance(msg, m.BatchPutRevoke), msg
        codes = []
        for k in msg.keys:  # abandoned puts (their ranges would wait out the write fence)
            held = self.resv.pop(k, None) is not None
            codes.append(int(m.Code.OK if self.pending.pop(k, None) is not None or held
                             else m.Code.NOT_PENDING))
        for k in msg.unused:  # reservations given back unwritten (freed at once)
            off = self.resv.pop(k, None)
            if off is not None:
                self.unused.append(off)
            codes.append(int(m.Code.OK if off is not None else m.Code.NOT_PENDING))
        return m.Codes(codes=codes)

    async def call(self, msg: m.Message) -> m.Message:
        await asyncio.sleep(self.rng.uniform(0, 0.002))  # the request on its way
        self.calls.append(type(msg).__name__)
        reply = self._handle(msg)
        await asyncio.sleep(self.rng.uniform(0, 0.002))  # the reply on its way
        return reply

    def flush_releases(self, queued_by: float = float("inf")) -> None:
        pass  # no reads: no lease releases

    def close(self) -> None:
        pass


class RecordingEngine:
    """Writes land after a random delay; each records its offset, and whether a committed
    value was there already. Every segment is registered, on another host (the client's
    `DirectSegments` looks each up)."""

    def __init__(self, master: RacyMaster) -> None:
        self.master = master
        self.writes: list[int] = []
        self.overwrote: list[str] = []
        self._batches: dict[int, list] = {}

    def describe(self, segment: str) -> SegmentDescriptor:
        return SegmentDescriptor(name=segment, engine_id="node", host_id="elsewhere",
                                 address="127.0.0.1:1", size=1 << 30)

    def submit(self, reqs: list, timeout: float, inline: bool = False) -> int:
        self._batches[len(self._batches)] = reqs
        return len(self._batches) - 1

    async def wait_async(self, bid: int) -> BatchStatus:
        reqs = self._batches[bid]
        await asyncio.sleep(self.master.rng.uniform(0, 0.002))  # the transfer on its way
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
            await asyncio.gather(*(c.put(k, b"x" * SIZE) for k in keys))
        await c.close()
        return master, engine

    for seed in range(20):
        master, engine = asyncio.run(run(seed))
        assert engine.overwrote == [], f"seed {seed}: committed values written over"
        assert len(engine.writes) == len(set(engine.writes)), f"seed {seed}: a range written twice"
        assert len(master.committed) == 48 and "PutCommit" in master.calls
        assert master.calls.count("PutCommit") + master.calls.count("PutEnd") == 48
        assert not master.resv  # close() gave the held one back
        assert master.unused and not set(master.unused) & set(engine.writes)  # as unwritten


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


def test_concurrent_same_shaped_batches_never_share_a_reservation() -> None:
    """Batches of one shape (and single puts of it) run concurrently: one batch at a time
    commits through the held reservations (`claim_many`), the others go two-phase; a reply in
    flight that still lists a claimed reservation never hands it to a second writer."""
    async def run(seed: int) -> tuple[RacyMaster, RecordingEngine]:
        master = RacyMaster(seed)
        engine = RecordingEngine(master)
        c = AsyncStoreClient(ClientConfig(direct=False, checksum=False), engine=engine)  # type: ignore[arg-type]
        c.rpc = master  # type: ignore[assignment]
        for wave in range(5):
            batches = [[f"w{wave}/{b}/{i}" for i in range(8)] for b in range(3)]
            got = await asyncio.gather(
                *(c.batch_put(keys, [b"x" * SIZE] * len(keys)) for keys in batches),
                *(c.put(f"w{wave}/single/{i}", b"y" * SIZE) for i in range(2)))
            assert got[:3] == [[0] * 8] * 3 and got[3:] == [1, 1]  # copies stored
        await c.close()
        return master, engine

    for seed in range(20):
        master, engine = asyncio.run(run(seed))
        assert engine.overwrote == [], f"seed {seed}: committed values written over"
        assert len(engine.writes) == len(set(engine.writes)), f"seed {seed}: a range written twice"
        assert len(master.consumed) == len(set(master.consumed))
        assert len(master.committed) == 5 * 26 and "BatchPutCommit" in master.calls
        assert not master.resv  # close() gave every held one back
        assert master.unused and not set(master.unused) & set(engine.writes)  # as unwritten


def test_a_stream_of_batches_commits_with_one_rpc_and_reports_existing_keys() -> None:
    async def run() -> tuple[RacyMaster, list[list[int]]]:
        master = RacyMaster(0)
        c = AsyncStoreClient(ClientConfig(direct=False), engine=RecordingEngine(master))  # type: ignore[arg-type]
        c.rpc = master  # type: ignore[assignment]
        master.keys.add("b3/5")  # stored by someone else
        codes = [await c.batch_put([f"b{b}/{i}" for i in range(8)],
                                   [bytes([b]) * SIZE] * 8) for b in range(5)]
        await c.close()
        return master, codes

    master, codes = asyncio.run(run())
    assert master.calls == ["BatchPutStart", "BatchPutEnd"] * 2 + ["BatchPutCommit"] * 3 + [
        "BatchPutRevoke"]  # the 2nd batch reserves the next's; close gives the last 8 back
    assert codes[3] == [0] * 5 + [int(m.Code.EXISTS)] + [0] * 2
    assert all(c == [0] * 8 for i, c in enumerate(codes) if i != 3)
    assert len(master.consumed) == 8 + 7 + 8  # the refused item's reservation served batch 4
    assert sorted(master.committed.values()) == sorted(
        f"b{b}/{i}" for b in range(5) for i in range(8) if (b, i) != (3, 5))
