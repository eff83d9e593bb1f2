"""One-RPC batch puts of the asyncio client with real master and node processes: a stream of
same-shaped batches goes through `BatchPutCommit` and reads back exactly, existing keys are
reported per key, concurrent batches never write one reservation twice, and a node killed under
a batch's reservations leaves no partial value readable."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
from store_procs import Proc, store_cluster

from yuebing.protocol import Message
from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient
from yuebing.store.config import ClientConfig as _ClientConfig


def ClientConfig(**kw):  # noqa: N802  reservations are a segment path: values the master
    return _ClientConfig(inline_max_bytes=0, **kw)  # holds itself would bypass them

C = m.Code


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, Proc, Proc]]:
    with store_cluster("abatchA", "abatchB") as (mst, a, b):
        yield mst, a, b


class Calls:
    """The master RPCs an `AsyncStoreClient` makes (heartbeats left out) with their replies;
    ``on_revoke`` runs (awaited) before a `BatchPutRevoke` is sent."""

    def __init__(self, c: AsyncStoreClient, on_revoke=None) -> None:
        self.sent: list[tuple[Message, Message]] = []
        self.names: list[str] = []
        call = c.rpc.call

        async def recording(msg: Message) -> Message:
            if isinstance(msg, m.BatchPutRevoke) and on_revoke is not None:
                await on_revoke(call, msg)
            reply = await call(msg)
            if not isinstance(msg, m.Heartbeat):
                self.sent.append((msg, reply))
                self.names.append(type(msg).__name__)
            return reply

        c.rpc.call = recording  # type: ignore[method-assign]

    def take(self) -> list[str]:
        out = list(self.names)
        self.names.clear()
        return out


def values(rng: np.random.Generator, n: int, size: int) -> list[np.ndarray]:
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


@pytest.mark.parametrize("direct", [True, False])
def test_async_stream_of_same_shaped_batches_costs_one_rpc_each(cluster, direct: bool) -> None:
    """As the sync client: the 2nd batch of a shape reserves the next batch's space, later ones
    are one write + one `BatchPutCommit`; an existing key is reported `EXISTS` (its reservation
    serves the next batch), a batch of mixed shapes is two-phase."""
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(5)
    pre = f"ab{int(direct)}/"

    async def run() -> None:
        async with AsyncStoreClient(ClientConfig(master=addr, direct=direct)) as c, \
                AsyncStoreClient(ClientConfig(master=addr)) as other:
            calls = Calls(c)
            per_batch = []
            for b in range(5):
                keys, vals = [f"{pre}{b}/{i}" for i in range(6)], values(rng, 6, 32 << 10)
                assert await c.batch_put(keys, vals) == [0] * 6
                per_batch.append(calls.take())
                assert await c.batch_get(keys) == [v.tobytes() for v in vals]
                calls.take()
            assert per_batch[:2] == [["BatchPutStart", "BatchPutEnd"]] * 2
            assert per_batch[2:] == [["BatchPutCommit"]] * 3
            assert (await other.stats())["reservations"] == 6
            await other.put(f"{pre}x/2", b"first")
            keys, vals = [f"{pre}x/{i}" for i in range(6)], values(rng, 6, 32 << 10)
            assert await c.batch_put_from(keys, vals) == [0, 0, int(C.EXISTS), 0, 0, 0]
            assert calls.take() == ["BatchPutCommit"]
            assert await c.get(f"{pre}x/2") == b"first"
            assert await c.batch_get([keys[i] for i in (0, 1, 3, 4, 5)]) == [
                vals[i].tobytes() for i in (0, 1, 3, 4, 5)]
            calls.take()
            assert await c.batch_put([f"{pre}y/{i}" for i in range(6)], vals) == [0] * 6
            assert calls.take() == ["BatchPutCommit"]  # the EXISTS item's reservation too
            assert await c.batch_put([f"{pre}z/0", f"{pre}z/1"], [vals[0], b"short"]) == [0, 0]
            assert calls.take() == ["BatchPutStart", "BatchPutEnd"]  # mixed shapes
            assert await c.get(f"{pre}z/1") == b"short"
            await other.remove_all(force=True)
        async with AsyncStoreClient(ClientConfig(master=addr)) as after:
            assert (await after.stats())["reservations"] == 0  # close() gave them all back

    asyncio.run(run())


@pytest.mark.parametrize("direct", [True, False])
def test_async_concurrent_batches_never_write_one_reservation_twice(cluster, direct: bool) -> None:
    """Waves of concurrent batches (and single puts) of one shape, each value distinct and
    checksummed: a reservation is committed into at most once, no value is written over (all
    read back exactly), and batches do go through `BatchPutCommit`. Through the engine
    (``direct`` off) a batch's write awaits, so another batch's `BatchPutStart` reaches the
    master first and its reply lists the reservations being written into."""
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(9)

    async def run() -> None:
        async with AsyncStoreClient(ClientConfig(master=addr, direct=direct)) as c:
            calls = Calls(c)
            stored: dict[str, bytes] = {}
            for wave in range(6):
                batches = [[f"cc{wave}/{b}/{i}" for i in range(8)] for b in range(4)]
                vals = [values(rng, 8, 16 << 10) for _ in batches]
                singles = values(rng, 3, 16 << 10)
                got = await asyncio.gather(
                    *(c.batch_put(k, v) for k, v in zip(batches, vals, strict=True)),
                    *(c.put(f"cc{wave}/s/{i}", v) for i, v in enumerate(singles)))
                assert got == [[0] * 8] * 4 + [1] * 3  # a put returns the copies stored
                for k, v in zip(batches, vals, strict=True):
                    stored.update((key, x.tobytes()) for key, x in zip(k, v, strict=True))
                stored.update((f"cc{wave}/s/{i}", v.tobytes()) for i, v in enumerate(singles))
            keys = list(stored)
            assert await c.batch_get(keys) == [stored[k] for k in keys]
            committed = Counter()
            for msg, reply in calls.sent:
                if isinstance(msg, m.BatchPutCommit):
                    assert isinstance(reply, m.BatchPutCommitted)
                    committed.update(r for r, code in zip(msg.reservations, reply.codes,
                                                          strict=True) if code == C.OK)
                elif isinstance(msg, m.PutCommit):
                    committed[msg.reservation] += 1
            assert committed and max(committed.values()) == 1
            assert "BatchPutCommit" in calls.names
            await c.remove_prefix("cc", force=True)

    asyncio.run(run())


@pytest.mark.slow
def test_async_node_killed_under_a_batch_leaves_no_partial_value() -> None:
    """The next batch's reservations lie on two nodes; one is killed: the writes to the other
    land, but the batch revokes every reservation — no key of it is readable then — and puts
    the batch again, two-phase, on the live node; every value reads back exactly."""
    with store_cluster("abkillA", "abkillB", dram="4MiB") as (mst, a, b):
        seg_a, seg_b = a.info["dram"], b.info["dram"]
        rng = np.random.default_rng(3)
        seen_at_revoke: list[list[bool]] = []

        async def run() -> None:
            async with AsyncStoreClient(ClientConfig(master=mst.info["address"])) as c:
                keys = [f"k/{i}" for i in range(8)]

                async def check(call, msg: m.BatchPutRevoke) -> None:
                    r = await call(m.BatchExists(keys=keys))
                    seen_at_revoke.append(r.values)

                calls = Calls(c, on_revoke=check)
                for n in range(2):
                    assert await c.batch_put([f"w/{n}/{i}" for i in range(8)],
                                             values(rng, 8, 100_000)) == [0] * 8
                (held,) = c._resv.held.values()
                spread = {r.segment for h in held for r in h.replicas}
                assert len(held) == 8 and spread == {seg_a, seg_b}  # free-ratio placement
                calls.take()
                a.kill()
                vals = values(rng, 8, 100_000)
                assert await c.batch_put(keys, vals) == [0] * 8
                assert calls.take() == ["BatchPutRevoke", "BatchPutStart", "BatchPutEnd"]
                assert seen_at_revoke == [[False] * 8]  # the half-written batch was never visible
                reps = await c.rpc.call(m.BatchGetReplicas(keys=keys))
                got = {r.segment for rs in reps.replicas for r in rs}  # type: ignore[attr-defined]
                assert got == {seg_b}
                assert await c.batch_get(keys) == [v.tobytes() for v in vals]
                st = await c.stats()
                assert st["suspects"] == 1 and st["pending"] == 0, st

        asyncio.run(run())
