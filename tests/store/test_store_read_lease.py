"""Reads never outlive their read lease (`store/client`): a fake master answers replica
requests with a short lease and a fake transfer engine stalls reads of one segment (a node
stopped mid-read) until the batch's timeout; the client must cut the read at its lease
deadline, never start the fallback replica past it, and ask for the replicas again."""

from __future__ import annotations

import asyncio
import time

import pytest

from yuebing.protocol import store as m
from yuebing.store.client import gets
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.config import ClientConfig
from yuebing.transfer import BatchStatus, SegmentDescriptor, TransferStatus
from yuebing.transfer.types import RequestStatus

LEASE = 0.3
DEADLINE = LEASE - gets.lease_margin(LEASE)  # after the request was sent
VALUES = {"a": b"A" * 64, "b": b"B" * 32}


Layout = dict[str, list[str]]
STALL: Layout = {"a": ["stopped/dram", "a/dram"], "b": ["b/dram"]}
MOVED: Layout = {"a": ["a/dram"], "b": ["b/dram"]}  # the stopped node's replica dropped


class FakeMaster:
    """Answers the n-th (batch) get_replicas from ``layouts[n]`` (the last one once past
    them): key -> replica segments, read in order; records each request and its send time.
    Each reply's lease has an id of its own (``granted``: (key, id)); a release is applied at
    once (``released``), as if the client's next call carried it."""

    def __init__(self, *layouts: Layout) -> None:
        self.layouts = layouts
        self.asked: list[tuple[float, m.Message]] = []
        self.granted: list[tuple[str, int]] = []
        self.released: list[tuple[str, int]] = []

    def _reply(self, key: str) -> m.ReplicaList:
        layout = self.layouts[min(len(self.asked) - 1, len(self.layouts) - 1)]
        reps = [m.Replica(segment=s, offset=0) for s in layout[key]]
        self.granted.append((key, len(self.granted) + 1))
        return m.ReplicaList(key=key, size=len(VALUES[key]), checksum=-1, replicas=reps,
                             lease_s=LEASE, lease_id=self.granted[-1][1])

    def call(self, msg: m.Message) -> m.Message:
        self.asked.append((time.monotonic(), msg))
        if isinstance(msg, m.GetReplicas):
            return self._reply(msg.key)
        assert isinstance(msg, m.BatchGetReplicas)
        rs = [self._reply(k) for k in msg.keys]
        return m.BatchReplicaList(codes=[0] * len(rs), sizes=[r.size for r in rs],
                                  checksums=[-1] * len(rs), replicas=[r.replicas for r in rs],
                                  lease_s=LEASE, lease_ids=[r.lease_id for r in rs])

    def release(self, keys: list[str], ids: list[int]) -> None:
        self.released += zip(keys, ids, strict=True)

    releases = 0  # none queued: each is applied when made
    failover_s = 0.0

    def take_releases(self, queued_by: float = float("inf")) -> bytes:
        return b""

    def send_releases(self, frames: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class AsyncFakeMaster(FakeMaster):
    async def call(self, msg: m.Message) -> m.Message:  # type: ignore[override]
        return super().call(msg)

    def flush_releases(self, queued_by: float = float("inf")) -> None:
        pass


class StallingEngine:
    """Reads of a segment in ``stalled`` stall until their batch's timeout (TIMEOUT, nothing
    copied); other segments hold the key's value. Records (segment, start, timeout). Every
    segment is registered, on another host (the client's `DirectSegments` looks each up)."""

    def __init__(self, stalled: set[str]) -> None:
        self.stalled = stalled
        self.started: list[tuple[str, float, float]] = []
        self._batches: dict[int, tuple[list, float]] = {}

    def describe(self, segment: str) -> SegmentDescriptor:
        return SegmentDescriptor(name=segment, engine_id="node", host_id="elsewhere",
                                 address="127.0.0.1:1", size=1 << 20)

    def submit(self, reqs: list, timeout: float, inline: bool = False) -> int:
        now = time.monotonic()
        self.started.extend((str(r.segment), now, timeout) for r in reqs)
        self._batches[len(self._batches)] = (reqs, timeout)
        return len(self._batches) - 1

    def _finish(self, bid: int) -> tuple[BatchStatus, float]:
        reqs, timeout = self._batches[bid]
        out, stall = [], 0.0
        for r in reqs:
            if str(r.segment) in self.stalled:
                stall = timeout
                out.append(RequestStatus(TransferStatus.TIMEOUT, 0, r.length, "timed out"))
            else:
                data = VALUES[str(r.segment).split("/")[0]]
                r.local[:len(data)] = data
                out.append(RequestStatus(TransferStatus.DONE, len(data), len(data)))
        worst = TransferStatus.TIMEOUT if stall else TransferStatus.DONE
        return BatchStatus(bid, worst, tuple(out)), stall

    def wait(self, bid: int) -> BatchStatus:
        st, stall = self._finish(bid)
        time.sleep(stall)  # the injected stall
        return st

    def transfer_status(self, reqs: list, timeout: float, inline: bool = True) -> BatchStatus:
        return self.wait(self.submit(reqs, timeout, inline))

    async def wait_async(self, bid: int) -> BatchStatus:
        st, stall = self._finish(bid)
        await asyncio.sleep(stall)  # the injected stall
        return st

    def free(self, bid: int) -> None:
        pass

    def close(self) -> None:
        pass


CFG = ClientConfig(direct=False, transfer_timeout_s=2.0, put_retries=1)


def sync_client(master: FakeMaster, engine: StallingEngine) -> StoreClient:
    c = StoreClient(CFG, engine=engine, heartbeat=False)  # type: ignore[arg-type]
    c.rpc = master  # type: ignore[assignment]
    return c


def check_bounded(master: FakeMaster, engine: StallingEngine) -> None:
    """Every read started, and was given a timeout ending, before the lease deadline of the
    latest replica request sent before it; every lease granted was released once, the read
    cut by it too (a lease ends when its reads end)."""
    assert sorted(master.released) == sorted(master.granted)
    for seg, start, timeout in engine.started:
        sent = max(t for t, _ in master.asked if t <= start)
        assert start < sent + DEADLINE, f"read of {seg} started past its lease"
        assert start + timeout <= sent + DEADLINE + 1e-3, f"read of {seg} may outlast its lease"


def test_read_deadline_keeps_a_margin() -> None:
    assert gets.read_deadline(10.0, 5.0) == pytest.approx(10.0 + 4.5)  # 10 %
    assert gets.read_deadline(10.0, 0.3) == pytest.approx(10.0 + 0.25)  # at least 50 ms
    assert gets.read_deadline(10.0, 0.06) == pytest.approx(10.0 + 0.03)  # at most half
    assert gets.read_deadline(10.0, 0.0) == float("inf")  # the master grants no lease


def test_get_asks_again_instead_of_a_fallback_past_the_lease() -> None:
    """The first replica's node stalls: the read is cut at the lease deadline, the second
    replica is not read under the old lease, the client asks again and reads the value."""
    master = FakeMaster(STALL, MOVED)
    engine = StallingEngine({"stopped/dram"})
    c = sync_client(master, engine)
    t0 = time.monotonic()
    got = c.get("a")
    assert bytes(got) == VALUES["a"]
    assert [type(msg) for _, msg in master.asked] == [m.GetReplicas, m.GetReplicas]
    assert [s for s, *_ in engine.started] == ["stopped/dram", "a/dram"]
    check_bounded(master, engine)
    assert time.monotonic() - t0 < LEASE + 0.5  # the stall was cut at the lease deadline
    c.close()


def test_get_raises_a_precise_error_when_every_lease_runs_out() -> None:
    master = FakeMaster({"a": ["stopped/dram"]})
    c = sync_client(master, StallingEngine({"stopped/dram"}))
    with pytest.raises(gets.ReadLeaseExpired, match=r"each of 2 read leases \(0.3s\) ran out"):
        c.get_into("a", bytearray(64))
    assert len(master.asked) == CFG.put_retries + 1
    check_bounded(master, c.engine)  # type: ignore[arg-type]
    c.close()


def test_batch_get_asks_again_only_for_keys_whose_lease_ran_out() -> None:
    master = FakeMaster(STALL, MOVED)
    engine = StallingEngine({"stopped/dram"})
    c = sync_client(master, engine)
    assert [bytes(v or b"") for v in c.batch_get(["a", "b"])] == [VALUES["a"], VALUES["b"]]
    asked = [msg for _, msg in master.asked]
    assert asked == [m.BatchGetReplicas(keys=["a", "b"]), m.BatchGetReplicas(keys=["a"])]
    assert "a/dram" not in [s for s, start, _ in engine.started
                            if start < master.asked[1][0]]  # no fallback under the old lease
    check_bounded(master, engine)
    c.close()


def test_async_get_and_batch_get_stay_within_the_lease() -> None:
    async def run() -> None:
        master = AsyncFakeMaster(STALL, MOVED, STALL, MOVED)
        engine = StallingEngine({"stopped/dram"})
        c = AsyncStoreClient(CFG, engine=engine)  # type: ignore[arg-type]
        c.rpc = master  # type: ignore[assignment]
        assert bytes(await c.get("a")) == VALUES["a"]
        assert [type(msg) for _, msg in master.asked] == [m.GetReplicas, m.GetReplicas]
        bufs = [bytearray(64), bytearray(32)]
        assert await c.batch_get_into(["a", "b"], bufs) == [64, 32]
        assert [bytes(b) for b in bufs] == [VALUES["a"], VALUES["b"]]
        assert master.asked[-1][1] == m.BatchGetReplicas(keys=["a"])
        check_bounded(master, engine)
        await c.close()

    asyncio.run(run())
