"""The shared view builder: the live adapter (`LiveCluster` over load reports + `KvIndex`) and
the simulator's (`MooncakeSystem` over its state + `GlobalKVPool`) given the same inputs build
the same `ClusterView` and so get the same decisions; plus the KV index and the store feed."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from policy_factories import PREDICTORS

from yuebing.conductor.cluster import LiveCluster, Member
from yuebing.conductor.kvfeed import StoreHoldings
from yuebing.conductor.policy import (
    ClusterView,
    PendingDecode,
    Policy,
    PolicyConfig,
    RequestInfo,
)
from yuebing.conductor.view import STORE_HOLDER, KvIndex
from yuebing.core.ids import BlockHash, InstanceId
from yuebing.instance.kvkeys import store_key
from yuebing.protocol.instance import Hello, LoadReport, Role
from yuebing.protocol.store_cluster import EventKind, KvEvents
from yuebing.sim.hardware import CostModel
from yuebing.sim.kvpool import GlobalKVPool
from yuebing.sim.loop import EventLoop
from yuebing.sim.mooncake import MooncakeSystem
from yuebing.sim.system import SimConfig, SystemContext, sim_policy

BT = 256
NOW = 100.0
CAPACITY = 160_000


class _Cost(CostModel):
    def __init__(self) -> None:
        self.kv_bytes_per_token = 1000
        self.decode_kv_capacity_tokens = CAPACITY
        self.link_Bps = 1e7
        self.link_latency_s = 0.0

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        return 1e-3 * new_tokens

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        return 0.05


def _hello(name: str, role: Role) -> Hello:
    return Hello(seq=0, instance_id=name, role=role, model="m", fingerprint="fp", host="h",
                 control_address=f"tcp://{name}:1", kv_segment="s", block_size=16,
                 store_block_tokens=BT, num_blocks=CAPACITY // 16, max_model_len=10**6,
                 incarnation="i")


def _report(name: str, queued_tokens: int, queued: int) -> LoadReport:
    return LoadReport(instance_id=name, incarnation="i", report_seq=1, time_s=0.0,
                      queued_prefill_tokens=queued_tokens, queued_requests=queued, running=0,
                      waiting=0, context_tokens=0, free_blocks=CAPACITY // 16,
                      total_blocks=CAPACITY // 16, reserved_blocks=0,
                      prefill_tokens_per_s=1000.0, decode_step_s=0.05)


def _live(queues: list[float], queued: list[int], decodes: int) -> LiveCluster:
    c = LiveCluster(2.0, 1.0, BT, PREDICTORS.prefill.predict, 1e7, 0.0)
    for i, (q, n) in enumerate(zip(queues, queued, strict=True)):
        mem = Member(f"tcp://p{i}:1", SimpleNamespace(), _hello(f"p{i}", Role.PREFILL),  # type: ignore[arg-type]
                     _report(f"p{i}", int(q * 1000), n), seen_s=NOW)
        c.members[mem.id] = mem
    for j in range(decodes):
        mem = Member(f"tcp://d{j}:1", SimpleNamespace(), _hello(f"d{j}", Role.DECODE),  # type: ignore[arg-type]
                     _report(f"d{j}", 0, 0), seen_s=NOW)
        c.members[mem.id] = mem
    return c


def _sim(queues: list[float], queued: list[int], decodes: int) -> MooncakeSystem:
    cfg = SimConfig(prefill_nodes=len(queues), decode_nodes=decodes,
                    policy=sim_policy(block_tokens=BT),
                    dram_kv_tokens=10**9)
    sim = MooncakeSystem(SystemContext(EventLoop(), _Cost(), cfg))
    sim.loop.now = NOW
    sim.free_at = [NOW + q for q in queues]
    sim.queued = list(queued)
    return sim


@pytest.mark.parametrize("selector, admission", [
    ("global_cache_aware", "none"), ("local_cache_aware", "none"), ("load_balance", "none"),
    ("random", "none"), ("global_cache_aware", "predictive_early_rejection")])
def test_live_and_simulated_views_give_the_same_decisions(selector: str, admission: str) -> None:
    rng = random.Random(7)
    queues, queued = [0.5, 1.25, 0.0, 2.0], [1, 2, 0, 3]
    sim, live = _sim(queues, queued, 2), _live(queues, queued, 2)
    predictive = admission == "predictive_early_rejection"  # the forecast, held while busy
    policy = Policy(PolicyConfig(prefill_selector=selector, block_tokens=BT,
                                 kv_bytes_per_token=1000, decode_durations_s=(10.0,),
                                 admission=admission, tbt_tail=2.0 if predictive else 1.0,
                                 decode_selector="forecast" if predictive else "least_loaded"),
                    PREDICTORS)
    docs = [[rng.randrange(1 << 60) for _ in range(12)] for _ in range(5)]
    for i in range(4):  # each prefill caches prefixes of some documents
        for d in rng.sample(docs, 3):
            keys = d[:rng.randint(1, 12)]
            sim.pool.insert(i, keys)
            live.index.add(f"p{i}", keys)
    pending = PendingDecode(NOW + 3.0, 50, InstanceId("d1"), 4000)
    sim.pending[0] = pending
    live.pending["x"] = pending
    prefills = [live.members[InstanceId(f"p{i}")] for i in range(4)]
    decodes = [live.members[InstanceId(f"d{j}")] for j in range(2)]
    decisions = set()
    for r in range(60):
        doc = rng.choice(docs)
        keys = tuple(BlockHash(k) for k in doc[:rng.randint(1, 12)])
        n = len(keys) * BT + rng.randint(0, BT - 1)
        info = RequestInfo(f"r{r}", NOW, n, keys, rng.randint(1, 500))
        sim_view = sim._view(None, *sim.pool.prefix_lengths(keys))  # type: ignore[arg-type]
        live_view = live.view(info, prefills, decodes, NOW)
        assert live_view == sim_view
        a, b = policy.decide(info, sim_view), policy.decide(info, live_view)
        assert a == b
        decisions.add((a.prefill_id, getattr(a, "fetch_blocks", 0) > 0))  # type: ignore[union-attr]
    if selector.endswith("cache_aware"):  # the workload exercises more than one outcome
        assert len(decisions) >= 2, decisions


def test_declared_groups_give_the_same_views_and_decisions() -> None:
    """Two single prefill instances and a pipeline group of two stages (live: ``--layers`` +
    ``--cpp-group g0`` instances; simulated: `SimConfig.cpp_groups`): long prompts go to the
    group unless its slowest stage's queue makes it lose, short ones to a single instance."""
    rng = random.Random(5)
    queues, queued = [0.5, 1.0], [1, 2]
    sim = MooncakeSystem(SystemContext(EventLoop(), _Cost(), SimConfig(
        prefill_nodes=2, decode_nodes=2, cpp_groups=1, policy=sim_policy(block_tokens=BT),
        dram_kv_tokens=10**9)))
    sim.loop.now = NOW
    sim.free_at, sim.queued = [NOW + q for q in queues], list(queued)
    live = _live(queues, queued, 2)
    for i in range(2):  # the group's stages, reporting like any instance
        h = msgspec.structs.replace(_hello(f"g0s{i}", Role.PREFILL), layers=f"{2 * i}:{2 * i + 2}",
                    num_layers=4, group="g0")
        live.members[h.instance_id] = Member(f"tcp://g0s{i}:1", SimpleNamespace(), h,  # type: ignore[arg-type]
                                             _report(h.instance_id, 0, 0), seen_s=NOW)
    prefills = live.alive(Role.PREFILL)
    decodes = live.alive(Role.DECODE)
    assert [m.id for m in prefills] == ["p0", "p1"]
    policy = Policy(PolicyConfig(prefill_selector="global_cache_aware", block_tokens=BT,
                                 kv_bytes_per_token=1000, decode_durations_s=(10.0,),
                                 cpp_threshold_tokens=1000, cpp_chunk_tokens=512), PREDICTORS)
    doc = [rng.randrange(1 << 60) for _ in range(16)]
    sim.pool.insert(0, doc[:4])
    live.index.add("p0", doc[:4])
    chosen = set()
    for r, (blocks, busy) in enumerate([(2, 0.0), (12, 0.0), (16, 0.0), (16, 9.0), (6, 0.0)]):
        sim.stage_free[0], sim.stage_queued[0] = NOW + busy, int(busy > 0)
        for i in range(2):
            m = live.members[InstanceId(f"g0s{i}")]
            m.report = _report(str(m.id), int(busy * 1000), int(busy > 0))
        keys = tuple(BlockHash(k) for k in doc[:blocks])
        info = RequestInfo(f"r{r}", NOW, blocks * BT, keys, 100)
        sim_view = sim._view(None, *sim.pool.prefix_lengths(keys))  # type: ignore[arg-type]
        live_view = live.view(info, prefills, decodes, NOW, live.groups())
        assert live_view == sim_view and len(live_view.groups) == 1
        a, b = policy.decide(info, sim_view), policy.decide(info, live_view)
        assert a == b
        chosen.add((blocks, busy, a.prefill_id))  # type: ignore[union-attr]
    assert {(16, 0.0, "g0"), (16, 9.0, "p0"), (2, 0.0, "p0")} <= chosen, chosen


def test_groups_need_every_stage_alive_and_ranges_that_tile_the_model(caplog: Any) -> None:
    live = _live([], [], 1)

    def stage(name: str, layers: str, group: str) -> Member:
        h = msgspec.structs.replace(_hello(name, Role.PREFILL), layers=layers, num_layers=4,
                                    group=group)
        m = Member(f"tcp://{name}:1", SimpleNamespace(), h,  # type: ignore[arg-type]
                   _report(name, 0, 0), seen_s=NOW)
        live.members[m.id] = m
        return m
    stage("a1", "2:4", "a")
    a0 = stage("a0", "0:2", "a")
    stage("b0", "0:3", "b")
    stage("b1", "2:4", "b")
    stage("c0", "0:2", "c")  # c1 has not joined (yet)
    assert [(g, [m.id for m in ms]) for g, ms in live.groups()] == [("a", ["a0", "a1"])]
    assert live.alive(Role.PREFILL) == []  # stages never serve alone
    assert "pipeline group 'b' is not used: layer ranges 0:3, 2:4 overlap at 2:3" in caplog.text
    a0.alive = False
    assert live.groups() == []


def test_kv_index_matches_the_simulated_pool() -> None:
    rng = random.Random(3)
    pool, index = GlobalKVPool(5, 10**6), KvIndex()
    names = [f"p{i}" for i in range(5)]
    universe = [rng.randrange(1 << 60) for _ in range(40)]
    for _ in range(300):
        node = rng.randrange(5)
        start = rng.randrange(40)
        keys = universe[start:start + rng.randint(1, 10)]
        pool.insert(node, keys)
        index.add(names[node], keys)
        q = universe[rng.randrange(5):][:rng.randint(0, 15)]
        lengths, best, holder = pool.prefix_lengths(q)
        got = index.lookup(q, names)
        assert list(got.local_blocks) == lengths and got.best_blocks == best
        assert got.holder == (names[holder] if best else None)


def test_kv_index_prefers_the_store_and_follows_removals() -> None:
    index = KvIndex()
    index.add("p0", [1, 2, 3])
    index.add(STORE_HOLDER, [1, 2, 3, 4])
    index.add("p1", [1, 2, 3, 4])
    got = index.lookup([1, 2, 3, 4, 5], ["p0", "p1"])
    assert (got.local_blocks, got.best_blocks, got.holder) == ((3, 4), 4, STORE_HOLDER)
    index.remove(STORE_HOLDER, [1])
    assert index.lookup([1, 2, 3, 4], ["p0", "p1"]).holder == "p1"
    assert index.run_of(STORE_HOLDER, [1, 2]) == 0 and index.run_of("p0", [1, 2, 9]) == 2
    index.replace("p1", [7])
    index.drop("p0")
    assert index.lookup([1, 2], ["p0", "p1"]).best_blocks == 0
    assert index.holders(7) == {"p1"} and index.holders(2) == {STORE_HOLDER}
    assert len(index) == 4  # 2, 3, 4 (store) and 7


def _events(seq: int, *items: tuple[int, str, list[str]]) -> KvEvents:
    return KvEvents(seq=seq, kinds=[k for k, _, _ in items], keys=[n for _, n, _ in items],
                      holders=[h for _, _, h in items])


def test_store_holdings_follow_events_and_resync() -> None:
    index = KvIndex()
    h = StoreHoldings(index, lambda: "fp")
    s, r = int(EventKind.STORED), int(EventKind.REMOVED)
    h.apply(_events(1, (s, store_key("fp", 10), ["a"]), (s, store_key("fp", 11), ["a", "b"]),
                    (s, store_key("other", 12), ["a"]), (s, "plain-key", ["a"])))
    assert index.keys_of(STORE_HOLDER) == {10, 11}
    h.apply(_events(2, (r, store_key("fp", 11), ["a"])))  # a replica remains on b
    assert index.keys_of(STORE_HOLDER) == {10, 11}
    h.apply(_events(3, (r, store_key("fp", 11), ["b"]), (r, store_key("fp", 99), ["a"])))
    assert index.keys_of(STORE_HOLDER) == {10}
    h.resync([store_key("fp", 20), store_key("fp", 21), store_key("other", 22), "x"])
    assert index.keys_of(STORE_HOLDER) == {20, 21}
    h.apply(_events(4, (r, store_key("fp", 20), ["z"])))  # resynced keys: any removal drops
    assert index.keys_of(STORE_HOLDER) == {21}


def test_store_holdings_keep_layer_range_objects_apart() -> None:
    index, ranges = KvIndex(), KvIndex()
    h = StoreHoldings(index, lambda: "fp", ranges)
    s, r = int(EventKind.STORED), int(EventKind.REMOVED)
    h.apply(_events(1, (s, store_key("fp", 10, (0, 2)), ["a"]),
                    (s, store_key("fp", 10, (2, 4)), ["a"]), (s, store_key("fp", 11), ["a"]),
                    (s, store_key("other", 12, (0, 2)), ["a"]), (s, "kv/fp/x@0:2", ["a"])))
    assert index.keys_of(STORE_HOLDER) == {11}  # range objects never count as whole blocks
    assert (ranges.keys_of("0:2"), ranges.keys_of("2:4")) == ({10}, {10})
    h.apply(_events(2, (r, store_key("fp", 10, (2, 4)), ["a"])))
    assert ranges.keys_of("2:4") == set() and ranges.keys_of("0:2") == {10}
    h.resync([store_key("fp", 20, (0, 2)), store_key("fp", 21)])
    assert ranges.keys_of("0:2") == {20} and index.keys_of(STORE_HOLDER) == {21}


def test_store_feed_end_to_end_with_a_real_master(tmp_path: Any) -> None:
    pytest.importorskip("zmq")
    import asyncio
    import time

    import zmq

    from yuebing.conductor.kvfeed import StoreFeed
    from yuebing.protocol import encode

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    async def run() -> set[int]:
        index = KvIndex()
        feed = StoreFeed(f"tcp://127.0.0.1:{port}", "", StoreHoldings(index, lambda: "fp"),
                         asyncio.get_running_loop()).start()
        try:
            end = time.monotonic() + 10
            seq = 0
            while 5 not in index.keys_of(STORE_HOLDER):  # PUB/SUB: resend until it settles
                assert time.monotonic() < end
                seq += 1
                pub.send(encode(KvEvents(seq=seq, kinds=[0], keys=[store_key("fp", 5)],
                                            holders=[["seg"]])))
                await asyncio.sleep(0.05)
            return set(index.keys_of(STORE_HOLDER))
        finally:
            feed.close()

    try:
        assert asyncio.run(run()) == {5}
    finally:
        pub.close(0)


def test_requests_waiting_in_the_gate_and_in_a_simulated_queue_give_the_same_views() -> None:
    """Both adapters put their not-yet-started requests in the view, and the policy charges a
    new request the same order-aware queue wait."""
    import asyncio

    from yuebing.conductor.gate import PrefillGate
    from yuebing.conductor.policy import QueuedPrefill
    from yuebing.sim.mooncake import _Waiting

    policy = Policy(PolicyConfig(block_tokens=BT, kv_bytes_per_token=1000,
                                 decode_durations_s=(10.0,), prefill_queue="sjf_aging"),
                    PREDICTORS)
    waiting = {0: [QueuedPrefill("a", NOW - 2, 3.0, NOW + 28), QueuedPrefill("b", NOW - 1, 0.2,
                                                                           NOW + 29)],
               1: [QueuedPrefill("c", NOW - 1, 0.5, NOW + 29)]}
    queues, queued = [1.5, 0.25], [3, 2]
    sim, live = _sim(queues, queued, 1), _live(queues, queued, 1)
    for i, items in waiting.items():
        sim.waiting[i] = [_Waiting(None, None, 0, 0, 0.0, w) for w in items]  # type: ignore[arg-type]

    info = RequestInfo("new", NOW, 1000, (), 50)
    prefills = [live.members[InstanceId(f"p{i}")] for i in range(2)]

    async def live_view_with_waiters() -> ClusterView:
        for i, items in waiting.items():
            m = prefills[i]
            m.gate = PrefillGate(1, policy.queue_order, clock=lambda: NOW)
            await m.gate.acquire(f"run{i}", 1)
            m.prefilling[f"run{i}"] = (queues[i], NOW)
            for w in items:
                asyncio.ensure_future(m.gate.acquire(w.request_id, 1, w))
                m.prefilling[w.request_id] = (w.prefill_s, w.arrival_s)
        await asyncio.sleep(0)
        return live.view(info, prefills, [live.members[InstanceId("d0")]], NOW)
    live_view = asyncio.run(live_view_with_waiters())
    sim_view = sim._view(None, [0, 0], 0, 0)  # type: ignore[arg-type]
    assert live_view == sim_view
    assert [p.queue_s for p in live_view.prefills] == [pytest.approx(4.7), pytest.approx(0.75)]
    route = policy.decide(info, live_view)
    assert route == policy.decide(info, sim_view)
    # 1 s of prefill (+ 0.1·NOW) goes before "a" (3 s) on p0, after "b" (0.2 s): 1.5 + 0.2
    assert policy.queue_wait(live_view, 0, 1.0) == pytest.approx(1.7)
    assert policy.queue_wait(live_view, 1, 1.0) == pytest.approx(0.75)  # after "c" (0.5 s)


def test_group_twins_give_the_same_views_and_decisions() -> None:
    """A pipeline group with a whole-model twin beside each stage (live: ``--twin-of``
    instances; simulated: `SimConfig.cpp_twins`) and one single instance: short prompts go to a
    twin while the group is idle, to the group or the single instance while it is busy; long
    ones wait for the twins' work."""
    rng = random.Random(7)
    sim = MooncakeSystem(SystemContext(EventLoop(), _Cost(), SimConfig(
        prefill_nodes=1, decode_nodes=1, cpp_groups=1, cpp_twins=True,
        policy=sim_policy(block_tokens=BT), dram_kv_tokens=10**9)))
    sim.loop.now = NOW
    assert sim.prefill_ids == ["p0", "g0t0", "g0t1"]
    live = _live([2.0], [1], 1)
    for i in range(2):
        for name, field in ((f"g0s{i}", "layers"), (f"g0t{i}", "twin_of")):
            h = msgspec.structs.replace(_hello(name, Role.PREFILL), num_layers=4, group="g0",
                                        **{field: f"{2 * i}:{2 * i + 2}"})
            live.members[h.instance_id] = Member(f"tcp://{name}:1", SimpleNamespace(), h,  # type: ignore[arg-type]
                                                 _report(name, 0, 0), seen_s=NOW)
    prefills, decodes = live.alive(Role.PREFILL), live.alive(Role.DECODE)
    assert [m.id for m in prefills] == ["p0", "g0t0", "g0t1"]
    assert [m.id for m in live.twins(live.groups()[0][1])] == ["g0t0", "g0t1"]
    policy = Policy(PolicyConfig(prefill_selector="global_cache_aware", block_tokens=BT,
                                 kv_bytes_per_token=1000, decode_durations_s=(10.0,),
                                 cpp_threshold_tokens=1000, cpp_chunk_tokens=512), PREDICTORS)
    doc = [rng.randrange(1 << 60) for _ in range(16)]
    sim.free_at[0], sim.queued[0] = NOW + 2.0, 1
    sim.pool.insert(2, doc[:4])
    live.index.add("g0t1", doc[:4])
    chosen = []
    for r, (blocks, busy, twin_q) in enumerate([(2, 0.0, 0.0), (12, 0.0, 0.0), (2, 3.0, 0.0),
                                               (16, 0.0, 1.5), (6, 0.0, 0.5), (16, 0.0, 0.0)]):
        sim.stage_free[0], sim.stage_queued[0] = NOW + busy, int(busy > 0)
        sim.free_at[1], sim.queued[1] = NOW + twin_q, int(twin_q > 0)
        for name, (q, n) in {"g0s0": (busy, int(busy > 0)), "g0s1": (busy, int(busy > 0)),
                             "g0t0": (twin_q, int(twin_q > 0))}.items():
            live.members[InstanceId(name)].report = _report(name, int(q * 1000), n)
        keys = tuple(BlockHash(k) for k in doc[:blocks])
        info = RequestInfo(f"r{r}", NOW, blocks * BT, keys, 100)
        sim_view = sim._view(None, *sim.pool.prefix_lengths(keys))  # type: ignore[arg-type]
        live_view = live.view(info, prefills, decodes, NOW, live.groups())
        assert live_view == sim_view and len(live_view.groups[0].twins) == 2
        a, b = policy.decide(info, sim_view), policy.decide(info, live_view)
        assert a == b
        chosen.append((a.prefill_id, a.est_queue_s))  # type: ignore[union-attr]
    assert chosen[0] == ("g0t1", 0.0)   # short, idle group: the twin holding its prefix
    assert chosen[1] == ("g0", 0.0)     # long: the group
    assert chosen[2][0] in ("g0", "p0")  # short, group busy: never a twin
    assert chosen[3] == ("g0", 1.5)     # long: the group waits for twin g0t0's work
    assert chosen[4][0] == "g0t1"       # 1536 tokens, 1024 cached on g0t1: 512 new, a twin's
