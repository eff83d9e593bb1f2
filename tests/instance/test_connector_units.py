"""KVConnector without a store process: staging bounds, partial snapshots, keys."""

from __future__ import annotations

import math
import threading
import time

import torch

from silent_master import silent_master
from yuebing.core.errors import StoreError
from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.connector import KVConnector, KVConnectorConfig
from yuebing.instance.staging import Staging
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

TINY = "dummy:preset=tiny,vocab=512,layers=2,hidden=64,heads=4,kv_heads=2,ffn=64,ctx=4096,tie=0"


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, num_blocks=512))


def test_snapshot_saves_the_leading_blocks_that_fit_in_staging():
    e = _engine()
    ids = [(i * 13) % 500 for i in range(1024)]  # 4 store blocks of 256
    e.generate([ids], SamplingParams(max_tokens=1))
    probe = KVConnector(e, None, KVConnectorConfig(staging_bytes=1 << 20))
    room = 2 * probe.object_bytes + 100  # two store blocks fit, not four
    conn = KVConnector(e, object(), KVConnectorConfig(  # type: ignore[arg-type]
        staging_bytes=room, save_staging_share=1.0))
    snap = conn.snapshot(e, ids)
    assert snap is not None and snap.keys == conn.keys(ids)[:2]
    assert conn.stats.staging_full == 1
    data = snap.data.view(e.pool.dtype).view(32, *e.pool.block_shape)
    blocks = [e.allocator.lookup(k, ids[i * 16:(i + 1) * 16])
              for i, k in enumerate(e.block_keys(ids)[:32])]
    assert torch.equal(data, e.pool.export_blocks(blocks))
    assert conn.snapshot(e, ids) is None  # no room left until the save gives it back
    conn.staging.give(snap.lease)


def test_staging_is_first_fit_and_bounded():
    s = Staging(torch.empty(100, dtype=torch.uint8))
    a, b = s.take(40), s.take(40)
    assert a is not None and b is not None and s.take(30) is None
    s.give(a[0])
    c = s.take(30)
    assert c is not None and c[0] == a[0]  # reuses the freed front
    # free now: 30..40 and 80..100
    assert s.take(21) is None
    d, e = s.take(20), s.take(10)
    assert d is not None and d[0] - 1 == 80 and e is not None and e[0] - 1 == 30
    assert s.take(1) is None


def test_saves_hold_at_most_their_share_of_staging_and_loads_keep_the_rest():
    s = Staging(torch.empty(100, dtype=torch.uint8), save_limit=50)
    a = s.take(30, saving=True)
    assert a is not None and s.take(30, saving=True) is None  # 60 > 50: the saves' share
    assert s.take(70) is not None  # a load takes all the rest
    s.give(a[0])
    assert s.take(30, saving=True) is not None  # the share is free again


class _StuckSaver:
    """The store client of saves, on a master that does not answer: each call blocks until
    ``answer`` is set (a real client waits out its failover budget, 15 s)."""

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.called: list[list[str]] = []

    def batch_exists(self, keys: list[str]) -> list[bool]:
        self.called.append(list(keys))
        self.answer.wait(10)
        return [True] * len(keys)


class _EmptyStore:
    def prefix_match(self, keys: list[str]) -> int:
        return 0


def test_a_fetch_does_not_wait_for_a_save_and_saves_keep_their_order():
    """Regression: loads and saves shared one I/O thread, so a load waited for a save stuck
    on the store (up to the client's failover budget, 15 s). Saves now have their own thread
    and store client; they still run one at a time, in order, and their snapshots hold at most
    `save_staging_share` of the staging, so a load finds room while they wait."""
    e = _engine()
    ids = [(i * 13) % 500 for i in range(512)]  # 2 store blocks of 256
    other = [(i * 7) % 500 for i in range(512)]
    e.generate([ids, other], SamplingParams(max_tokens=1))
    probe = KVConnector(e, None, KVConnectorConfig(staging_bytes=1 << 20))
    saver = _StuckSaver()
    conn = KVConnector(e, _EmptyStore(), KVConnectorConfig(  # type: ignore[arg-type]
        staging_bytes=8 * probe.object_bytes, save_staging_share=0.5), saver=saver)  # type: ignore[arg-type]
    try:
        first, second = conn.snapshot(e, ids), conn.snapshot(e, other)
        assert first is not None and second is not None  # 4 blocks: the saves' half
        assert conn.snapshot(e, ids[:256] + other[:256]) is None  # no share left
        saves = [conn.submit_save(first), conn.submit_save(second)]
        end = time.monotonic() + 5
        while not saver.called and time.monotonic() < end:
            time.sleep(0.01)
        assert saver.called == [first.keys]  # the first save is stuck on the master
        t0 = time.monotonic()
        assert conn.submit_fetch(ids, 512).result(timeout=5).blocks == 0  # a miss, at once
        assert time.monotonic() - t0 < 1.0
        assert conn.staging.take(4 * probe.object_bytes) is not None  # loads' half is free
        saver.answer.set()
        assert [f.result(timeout=5) for f in saves] == [0, 0]  # both were present
        assert saver.called == [first.keys, second.keys]  # in order
    finally:
        saver.answer.set()
        conn.close()


def test_a_background_job_that_raises_fails_its_task_with_an_error_event():
    import asyncio
    from types import SimpleNamespace

    from yuebing.instance.base import Instance, Task
    from yuebing.protocol.instance import ErrorCode

    failed: list[tuple[str, ErrorCode, str]] = []
    stub = SimpleNamespace(_handlers=set(),
                           fail=lambda t, c, e: failed.append((t.request_id, c, e)))
    task = Task("r1", b"owner", [1, 2], SamplingParams())

    async def boom() -> None:
        raise KeyError("lost")

    async def fine() -> None:
        return None

    async def go() -> None:
        Instance.spawn(stub, task, boom())  # type: ignore[arg-type]
        Instance.spawn(stub, Task("r2", b"o", [1], SamplingParams()), fine())  # type: ignore[arg-type]
        for _ in range(100):  # until both jobs are done and forgotten
            if not stub._handlers:
                break
            await asyncio.sleep(0)
    asyncio.run(go())
    assert failed == [("r1", ErrorCode.INTERNAL, "KeyError: 'lost'")]
    assert not stub._handlers


class _DownStore:
    """A store whose master is out of reach: every call raises (after a client's failover
    budget, in a real client) and is counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.last_heartbeat = 0.0  # as `StoreClient`: the master's last answer

    def _fail(self, *args: object) -> None:
        self.calls += 1
        raise StoreError("master tcp://10.0.0.1:1 did not answer within 5.0s (failover budget "
                         "spent)")

    prefix_match = batch_exists = batch_get_into = batch_put = _fail


def test_a_failed_store_call_makes_loads_and_saves_skip_the_store_for_a_while():
    """Regression (issue 16, the store cut from a prefill's host): every load and save waited
    out the store client's failover budget (15 s) on the connector's single I/O thread, so a
    request whose prefix the Conductor planned from the store took 15-30 s. Now one failed call
    makes the next ones skip the store for `store_retry_s` and until the client's heartbeat is
    answered again; then a call tries again."""
    e = _engine()
    ids = [(i * 13) % 500 for i in range(512)]  # 2 store blocks of 256
    e.generate([ids], SamplingParams(max_tokens=1))
    store = _DownStore()
    conn = KVConnector(e, store, KVConnectorConfig(staging_bytes=1 << 22,  # type: ignore[arg-type]
                                                   store_retry_s=0.3))
    assert conn.fetch(ids, 512).blocks == 0 and store.calls == 1  # tried, failed: computed
    assert conn.fetch(ids, 512).blocks == 0 and store.calls == 1  # skipped
    snap = conn.snapshot(e, ids)
    assert snap is not None
    assert conn.save(snap) == 0 and store.calls == 1  # dropped without a call
    assert conn.stats.store_skipped == 2
    assert conn.staging.take(1 << 22) is not None  # every staging byte given back
    time.sleep(0.35)  # past store_retry_s: the skipping window is over
    assert conn.fetch(ids, 512).blocks == 0 and store.calls == 1  # no heartbeat answered yet
    store.last_heartbeat = time.monotonic()  # the master answers again
    assert conn.fetch(ids, 512).blocks == 0 and store.calls == 2  # tries again


def test_the_first_load_gives_up_on_a_master_that_never_answers_within_load_timeout_s():
    """Regression (a store master stopped, or cut from the prefill's host with its connection
    stalled): the first load that met it waited out the store client's failover budget (15 s
    of 5 s tries) on the request's TTFT path before the prefix was computed; only later loads
    skipped the store. Now each master call of a load gives up after `load_timeout_s`: the
    load is a miss (nothing staged or installed: the engine computes the prefix), the next
    loads skip the store, and the client's calls outside a load keep their budget."""
    e = _engine()
    ids = [(i * 13) % 500 for i in range(512)]  # 2 store blocks of 256
    e.generate([ids], SamplingParams(max_tokens=1))
    with silent_master() as master:
        client = StoreClient(ClientConfig(master=master.address), heartbeat=False)
        try:
            conn = KVConnector(e, client, KVConnectorConfig(staging_bytes=1 << 22,
                                                            load_timeout_s=0.5))
            t0 = time.monotonic()
            loaded = conn.fetch(ids, 512)
            took = time.monotonic() - t0
            assert loaded.blocks == 0 and loaded.data is None and loaded.lease == 0
            assert 0.45 <= took < 0.5 + 1.0, took  # was 15 s
            assert master.received > 0  # the lookup reached the master, which never answered
            assert client.rpc.call_limit_s == math.inf  # a save is not limited
            assert conn.install(e, ids, loaded) == 0
            t0 = time.monotonic()
            assert conn.fetch(ids, 512).blocks == 0 and conn.stats.store_skipped == 1
            assert time.monotonic() - t0 < 0.1  # skipped: no call
            assert conn.stats.loads == 0 and conn.stats.loaded_tokens == 0
            assert conn.staging.take(1 << 22) is not None  # every staging byte given back
        finally:
            client.close()


def test_stats_counted_from_many_threads_at_once_lose_no_count():
    """Regression: the stats were bumped with a plain ``+=`` from the driver, load and save
    threads, which may lose a count when threads switch in between; `ConnectorStats.add`
    counts under a lock. A tiny switch interval makes threads switch inside any unlocked
    read-add-write (an `add` without its lock loses some of these counts)."""
    import sys

    from yuebing.instance.connector import ConnectorStats

    stats, threads, rounds = ConnectorStats(), 8, 5000

    def count() -> None:
        for _ in range(rounds):
            stats.add(staging_full=1)
            stats.add(loads=1, loaded_bytes=3)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        workers = [threading.Thread(target=count) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(old)
    assert (stats.staging_full, stats.loads, stats.loaded_bytes) == (
        threads * rounds, threads * rounds, 3 * threads * rounds)


def test_close_ends_a_save_stuck_on_a_master_that_never_answers_within_its_grace():
    """Regression: closing the connector dropped the queued saves but left the running one
    on its store call, which waited out the client's failover budget (15 s) for a master that
    does not answer — and the process's exit waited for the save thread as long; closing the
    clients waited for their heartbeat's call too (up to 7 s). Now the running save gets
    `close_grace_s`, then its call fails (`StoreClient.cut_calls`), and a client's close ends
    its heartbeat at once."""
    e = _engine()
    ids = [(i * 13) % 500 for i in range(512)]  # 2 store blocks of 256
    other = [(i * 7) % 500 for i in range(512)]
    e.generate([ids, other], SamplingParams(max_tokens=1))
    grace = 0.5
    with silent_master() as master:
        cfg = ClientConfig(master=master.address, heartbeat_s=0.2)  # a heartbeat is out too
        store, saver = StoreClient(cfg), StoreClient(cfg)
        conn = KVConnector(e, store, KVConnectorConfig(staging_bytes=1 << 22,
                                                       close_grace_s=grace), saver=saver)
        try:
            first, second = conn.snapshot(e, ids), conn.snapshot(e, other)
            assert first is not None and second is not None
            stuck, queued = conn.submit_save(first), conn.submit_save(second)
            end = time.monotonic() + 5
            while saver.rpc.sock is None:  # the save's first master call goes out
                assert time.monotonic() < end
                time.sleep(0.01)
            while master.received == 0:  # the save's call reached the master: it waits
                assert time.monotonic() < end
                time.sleep(0.01)
            call = master.received
            while master.received == call:  # a heartbeat's call too
                assert time.monotonic() < end
                time.sleep(0.01)
            assert not stuck.done()
            t0 = time.monotonic()
            conn.close()
            closed = time.monotonic() - t0
            for c in (saver, store):
                c.close()
            took = time.monotonic() - t0
        finally:
            conn.close()  # again after a failed assertion: no-ops otherwise
    assert stuck.done() and stuck.result() == 0 and conn.stats.save_failures == 1  # ended
    assert queued.cancelled()
    assert took < grace + 1.5, took  # was 15 s for the save's thread, 5 s for the clients
    assert grace <= closed < grace + 0.7, closed  # the save had its grace, no more
