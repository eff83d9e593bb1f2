"""Reserve-ahead puts with real master and node processes, sync and asyncio clients: a stream
of same-sized puts costs one RPC each and reads back intact (concurrent ones too); other sizes,
idle reservations, refused commits and dead nodes fall back to the two-phase put."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import numpy as np
import pytest
from store_procs import Proc, store_cluster

from yuebing.core.errors import InputError
from yuebing.protocol import Message
from yuebing.protocol import store as m
from yuebing.store.client.client import AsyncStoreClient, StoreClient
from yuebing.store.client.rpc import StoreRpcError
from yuebing.store.config import ClientConfig as _ClientConfig


def ClientConfig(**kw):  # noqa: N802  reservations are a segment path: values the master
    return _ClientConfig(inline_max_bytes=0, **kw)  # holds itself would bypass them


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Proc, Proc, Proc]]:
    with store_cluster("resvA", "resvB") as (mst, a, b):
        yield mst, a, b


class Calls:
    """Records the master RPCs a client makes (its heartbeat has its own connection)."""

    def __init__(self, c: StoreClient) -> None:
        self.msgs: list[Message] = []
        call = c.rpc.call

        def recording(msg: Message) -> Message:
            self.msgs.append(msg)
            return call(msg)

        c.rpc.call = recording  # type: ignore[method-assign]

    def take(self) -> list[str]:
        out = [type(x).__name__ for x in self.msgs]
        self.msgs.clear()
        return out


@pytest.mark.parametrize("direct", [True, False])
def test_stream_of_same_sized_puts_costs_one_rpc_each(cluster, direct: bool) -> None:
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(7)
    vals = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(12)]
    pre = f"s{int(direct)}/"
    with StoreClient(ClientConfig(master=addr, direct=direct, replicas=2)) as c, \
            StoreClient(ClientConfig(master=addr)) as other:
        calls = Calls(c)
        per_put = []
        for i, v in enumerate(vals):
            c.put(f"{pre}{i}", v)
            per_put.append(calls.take())
        assert per_put[:2] == [["PutStart", "PutEnd"]] * 2  # the 2nd asks for a reservation
        assert per_put[2:] == [["PutCommit"]] * 10  # steady state: one RPC per put
        c.put(f"{pre}odd", b"x" * 1000)  # another size: two-phase, the reservation stays
        assert calls.take() == ["PutStart", "PutEnd"]
        assert other.remove_all(force=True).n == 13  # removes values, never a reservation
        c.put(f"{pre}again", vals[0])
        assert calls.take() == ["PutCommit"]
        assert c.get(f"{pre}again") == vals[0].tobytes()
        calls.take()
        for i, v in enumerate(vals[:3]):
            c.put(f"{pre}{i}", v)
        assert calls.take() == ["PutCommit"] * 3
        assert [c.get(f"{pre}{i}") for i in range(3)] == [v.tobytes() for v in vals[:3]]
        reps = c.rpc.call(m.GetReplicas(key=f"{pre}1")).replicas  # type: ignore[attr-defined]
        assert len({r.segment for r in reps}) == 2  # the reservation had the put's 2 replicas
        assert other.stats()["reservations"] == 1 and other.stats()["objects"] == 4
        assert (c.engine.stats()["endpoints"] == 0) is direct  # same-host copies into it
    with StoreClient(ClientConfig(master=addr)) as after:
        assert after.stats()["reservations"] == 0  # close() gave it back
        after.remove_all(force=True)


@pytest.mark.parametrize("direct", [True, False])
def test_stream_of_same_shaped_batches_costs_one_rpc_each(cluster, direct: bool) -> None:
    """Batches (a prefill storing its blocks): the 2nd batch of a shape reserves the next
    batch's space, later ones are one write + one `BatchPutCommit`; items whose key exists are
    reported, the others stored; a batch of another shape or of mixed shapes is two-phase."""
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(11)
    vals = [rng.integers(0, 256, 32 << 10, dtype=np.uint8) for _ in range(6)]
    pre = f"b{int(direct)}/"
    with StoreClient(ClientConfig(master=addr, direct=direct)) as c, \
            StoreClient(ClientConfig(master=addr)) as other:
        calls = Calls(c)
        per_batch = []
        for b in range(5):
            keys = [f"{pre}{b}/{i}" for i in range(6)]
            assert c.batch_put(keys, vals) == [0] * 6
            per_batch.append(calls.take())
            assert c.batch_get(keys) == [v.tobytes() for v in vals]
            calls.take()
        assert per_batch[:2] == [["BatchPutStart", "BatchPutEnd"]] * 2
        assert per_batch[2:] == [["BatchPutCommit"]] * 3
        assert other.stats()["reservations"] == 6
        other.put(f"{pre}x/2", b"first")  # one key of the next batch exists already
        keys = [f"{pre}x/{i}" for i in range(6)]
        assert c.batch_put(keys, vals) == [0, 0, int(m.Code.EXISTS), 0, 0, 0]
        assert calls.take() == ["BatchPutCommit"]
        assert c.get(f"{pre}x/2") == b"first" and c.get(f"{pre}x/5") == vals[5].tobytes()
        calls.take()
        assert other.stats()["reservations"] == 6  # the refused item's reservation is reused
        assert c.batch_put([f"{pre}y/{i}" for i in range(6)], vals) == [0] * 6
        assert calls.take() == ["BatchPutCommit"]
        assert c.batch_put([f"{pre}z/0", f"{pre}z/1"], [vals[0], b"short"]) == [0, 0]
        assert calls.take() == ["BatchPutStart", "BatchPutEnd"]  # mixed shapes
        assert c.get(f"{pre}z/1") == b"short"
        calls.take()
        c.put(f"{pre}single", vals[0])  # a single put of the shape may use one of them
        assert calls.take() == ["PutCommit"]
        assert c.get(f"{pre}single") == vals[0].tobytes()
        other.remove_all(force=True)
    with StoreClient(ClientConfig(master=addr)) as after:
        assert after.stats()["reservations"] == 0  # close() gave them all back


def test_switched_off_and_reserved_keys_refused(cluster) -> None:
    addr = cluster[0].info["address"]
    with StoreClient(ClientConfig(master=addr, reserve_ahead=False)) as c:
        calls = Calls(c)
        for i in range(4):
            c.put(f"off/{i}", bytes([i]) * 5000)
        assert calls.take() == ["PutStart", "PutEnd"] * 4
        with pytest.raises(InputError, match="reserved"):
            c.put(m.RESERVED_PREFIX + "mine", b"1")
        with pytest.raises(StoreRpcError, match="reserved"):
            c.rpc.call(m.PutStart(client=c.client_id,
                                  item=m.PutItem(key=m.RESERVED_PREFIX + "mine", size=1)))
        assert c.get("off/3") == b"\x03" * 5000
        c.remove_all(force=True)


def test_commit_applied_twice_as_after_a_lost_reply_still_succeeds(cluster) -> None:
    """The RPC layer re-sends a commit after a lost reply or a failover: each `PutEnd` and
    `PutCommit` here reaches the master twice (the first reply dropped); every put returns,
    reads back and counts once; another client's commit of the key is still refused."""
    addr = cluster[0].info["address"]
    with StoreClient(ClientConfig(master=addr)) as c, \
            StoreClient(ClientConfig(master=addr)) as other:
        call, repeated = c.rpc.call, []

        def twice(msg: Message) -> Message:
            if isinstance(msg, (m.PutEnd, m.PutCommit)):
                call(msg)  # applied; its reply is lost
                repeated.append(type(msg).__name__)
            return call(msg)

        c.rpc.call = twice  # type: ignore[method-assign]
        puts = other.stats()["puts"]
        for i in range(4):
            c.put(f"twice/{i}", bytes([i]) * 5000)
        assert repeated == ["PutEnd", "PutEnd", "PutCommit", "PutCommit"]
        assert [c.get(f"twice/{i}") for i in range(4)] == [bytes([i]) * 5000 for i in range(4)]
        st = other.stats()
        assert st["puts"] == puts + 4 and st["reservations"] == 1
        with pytest.raises(StoreRpcError, match="NOT_PENDING"):
            other.rpc.call(m.PutEnd(client=other.client_id, key="twice/0"))
        c.remove_all(force=True)


def test_reservation_idle_too_long_is_not_used(cluster) -> None:
    # a 1 s transfer timeout makes the master give 1 s of write time: usable for 0.5 s
    with StoreClient(ClientConfig(master=cluster[0].info["address"],
                                  transfer_timeout_s=1.0)) as c:
        calls = Calls(c)
        for i in range(3):
            c.put(f"idle/{i}", bytes([i]) * 5000)
        assert calls.take()[-1:] == ["PutCommit"]
        time.sleep(0.6)  # half the write time passes
        c.put("idle/3", b"\x03" * 5000)  # the held one has < half its write time left
        assert calls.take() == ["BatchPutRevoke", "PutStart", "PutEnd"]
        c.put("idle/4", b"\x04" * 5000)
        assert calls.take() == ["PutCommit"]
        time.sleep(1.3)  # past its write expiry: the master reclaimed it
        st = c.stats()
        assert st["reservations"] == 0 and st["reservations_expired"] >= 1 and st["zombies"] == 0
        c.put("idle/5", b"\x05" * 5000)
        assert calls.take() == ["GetStats", "PutStart", "PutEnd"]  # no revoke needed
        assert [c.get(f"idle/{i}") for i in range(6)] == [bytes([i]) * 5000 for i in range(6)]
        c.remove_all(force=True)


@pytest.mark.slow
def test_node_killed_under_a_reservation_put_lands_elsewhere() -> None:
    with store_cluster("resvKA", "resvKB", dram="4MiB") as (mst, a, b):
        seg_a, seg_b = a.info["dram"], b.info["dram"]
        with StoreClient(ClientConfig(master=mst.info["address"], preferred=(seg_a,),
                                      placement="preferred")) as c:
            calls = Calls(c)
            for i in range(2):
                c.put(f"k/{i}", bytes([i]) * 100_000)
            ((held,),) = c._resv.held.values()
            assert [r.segment for r in held.replicas] == [seg_a]
            calls.take()
            a.kill()
            c.put("k/2", b"\x02" * 100_000)  # write into the reservation fails: revoke, re-place
            assert calls.take() == ["BatchPutRevoke", "PutStart", "PutEnd"]
            reps = c.rpc.call(m.GetReplicas(key="k/2")).replicas  # type: ignore[attr-defined]
            assert [r.segment for r in reps] == [seg_b] and c.get("k/2") == b"\x02" * 100_000
            calls.take()
            c.put("k/3", b"\x03" * 100_000)  # the new reservation avoids the suspected node
            assert calls.take() == ["PutCommit"]
            assert c.get("k/3") == b"\x03" * 100_000
            st = c.stats()
            assert st["suspects"] == 1 and st["pending"] == 0


class AsyncCalls:
    """`Calls` for an `AsyncStoreClient` (its heartbeat task is filtered out)."""

    def __init__(self, c: AsyncStoreClient) -> None:
        self.msgs: list[Message] = []
        call = c.rpc.call

        async def recording(msg: Message) -> Message:
            if not isinstance(msg, m.Heartbeat):
                self.msgs.append(msg)
            return await call(msg)

        c.rpc.call = recording  # type: ignore[method-assign]

    def take(self) -> list[str]:
        out = [type(x).__name__ for x in self.msgs]
        self.msgs.clear()
        return out


def test_async_stream_one_rpc_each_and_concurrent_puts_intact(cluster) -> None:
    """The asyncio client: a sequential stream costs one RPC per put from the third; many
    concurrent puts of that shape (one may take the held reservation, the rest two-phase) all
    read back intact (checksums on); a refused commit falls back and its reservation is used
    again; close gives the held one back."""
    addr = cluster[0].info["address"]
    rng = np.random.default_rng(11)
    vals = [rng.integers(0, 256, 64 << 10, dtype=np.uint8) for _ in range(24)]

    async def run() -> None:
        async with AsyncStoreClient(ClientConfig(master=addr, replicas=2)) as c:
            calls = AsyncCalls(c)
            per_put = []
            for i in range(5):
                await c.put(f"as/{i}", vals[i])
                per_put.append(calls.take())
            assert per_put == [["PutStart", "PutEnd"]] * 2 + [["PutCommit"]] * 3
            keys = [f"ac/{i}" for i in range(len(vals))]
            for _ in range(3):  # concurrent waves of the same shape
                await asyncio.gather(*(c.put(k, v) for k, v in zip(keys, vals, strict=True)))
                assert await c.batch_get(keys) == [v.tobytes() for v in vals]
                assert (await c.remove_prefix("ac/", force=True)).n == len(keys)
            assert "PutCommit" in calls.take()
            with pytest.raises(StoreRpcError, match="EXISTS"):  # commit refused, then PutStart
                await c.put("as/0", vals[0])
            assert calls.take() == ["PutCommit", "PutStart"]
            await c.put("as/x", vals[1])  # the master answers with the same reservation
            await c.put("as/y", vals[2])
            assert calls.take() == ["PutStart", "PutEnd", "PutCommit"]
            assert [await c.get(k) for k in ("as/x", "as/y")] == [vals[1].tobytes(),
                                                                 vals[2].tobytes()]
            assert (await c.stats())["reservations"] == 1
        async with AsyncStoreClient(ClientConfig(master=addr)) as after:
            assert (await after.stats())["reservations"] == 0  # close() gave it back
            await after.remove_all(force=True)

    asyncio.run(run())


def test_async_reservation_idle_too_long_goes_back(cluster) -> None:
    async def run() -> None:
        async with AsyncStoreClient(ClientConfig(master=cluster[0].info["address"],
                                                 transfer_timeout_s=1.0)) as c:
            calls = AsyncCalls(c)
            for i in range(3):
                await c.put(f"aidle/{i}", bytes([i]) * 5000)
            assert calls.take()[-1:] == ["PutCommit"]
            await asyncio.sleep(0.6)  # half the write time passes
            await c.put("aidle/3", b"\x03" * 5000)  # < half its write time left: give back
            assert calls.take() == ["BatchPutRevoke", "PutStart", "PutEnd"]
            await c.put("aidle/4", b"\x04" * 5000)
            assert calls.take() == ["PutCommit"]
            assert [await c.get(f"aidle/{i}") for i in range(5)] == [
                bytes([i]) * 5000 for i in range(5)]
            await c.remove_all(force=True)

    asyncio.run(run())


@pytest.mark.slow
def test_async_node_killed_under_a_reservation_put_lands_elsewhere() -> None:
    with store_cluster("aresvKA", "aresvKB", dram="4MiB") as (mst, a, b):
        seg_a, seg_b = a.info["dram"], b.info["dram"]

        async def run() -> None:
            cfg = ClientConfig(master=mst.info["address"], preferred=(seg_a,),
                               placement="preferred")
            async with AsyncStoreClient(cfg) as c:
                calls = AsyncCalls(c)
                for i in range(2):
                    await c.put(f"k/{i}", bytes([i]) * 100_000)
                ((held,),) = c._resv.held.values()
                assert [r.segment for r in held.replicas] == [seg_a]
                calls.take()
                a.kill()
                await c.put("k/2", b"\x02" * 100_000)  # the write fails: revoke, re-place
                assert calls.take() == ["BatchPutRevoke", "PutStart", "PutEnd"]
                got = await c.rpc.call(m.GetReplicas(key="k/2"))
                reps = got.replicas  # type: ignore[attr-defined]
                assert [r.segment for r in reps] == [seg_b]
                assert await c.get("k/2") == b"\x02" * 100_000
                calls.take()
                await c.put("k/3", b"\x03" * 100_000)  # the new reservation avoids the suspect
                assert calls.take() == ["PutCommit"]
                assert await c.get("k/3") == b"\x03" * 100_000
                st = await c.stats()
                assert st["suspects"] == 1 and st["pending"] == 0

        asyncio.run(run())
