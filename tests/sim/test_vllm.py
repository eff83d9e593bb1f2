"""The coupled vLLM-like baselines: hand-timed scenarios on a round-number cost model, the
roofline step formulas, routing, and a regression run on a slice of the real trace.

Fake cost: prefill 1 ms per new token, every decode step 10 ms, 10,000 KV tokens of HBM. It is
not a roofline, so a mixed (chunked) step costs prefill + decode time.
"""

from __future__ import annotations

import math

import pytest

from yuebing.conductor.policy.types import RejectStage
from yuebing.core.errors import ConfigError
from yuebing.sim.hardware import CostModel, RooflineCostModel
from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord, effective_capacity
from yuebing.sim.system import SYSTEMS, SimConfig, SystemContext
from yuebing.sim.vllm import VARIANTS, VllmOptions, VllmSystem, register_variant, simulate_vllm
from yuebing.sim.vllm_cost import CoupledCost
from yuebing.sim.vllm_instance import CoupledInstance, CoupledJob
from yuebing.sim.workload import SimRequest, load_requests


class FakeCost(CostModel):
    kv_bytes_per_token = 1000
    decode_kv_capacity_tokens = 10_000
    link_Bps = 1e9
    link_latency_s = 0.0

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        return 0.001 * new_tokens

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        return 0.01


def make(capacity: int = 10_000, prefix: bool = False, chunked: bool = False,
         budget: int = 131_072, seqs: int = 256) -> tuple[EventLoop, CoupledInstance]:
    loop = EventLoop()
    inst = CoupledInstance("n0", loop, CoupledCost(FakeCost()), capacity, 100, prefix, chunked,
                           budget, seqs)
    return loop, inst


def submit_at(loop: EventLoop, inst: CoupledInstance, t: float, index: int, n_in: int,
              n_out: int, keys: tuple[int, ...] = ()) -> RequestRecord:
    req = SimRequest(index, t, n_in, n_out, keys)
    rec = RequestRecord(index, t, n_in, n_out)
    loop.at(t, Priority.ARRIVAL, inst.submit, CoupledJob(req, rec))
    return rec


def test_prefill_interrupts_running_decode():
    loop, inst = make()
    a = submit_at(loop, inst, 0.0, 0, 1000, 4)
    b = submit_at(loop, inst, 1.015, 1, 500, 3)
    loop.run()
    # A: prefill 1.0 s, tokens at 1.0, 1.01, 1.02; B's 0.5 s prefill stalls A; A's last at 1.53
    assert (a.first_token_s, a.finish_s) == pytest.approx((1.0, 1.53))
    assert a.tbt_s == pytest.approx(0.51) and a.tbt_mean_s == pytest.approx(0.53 / 3)
    assert (b.prefill_start_s, b.first_token_s, b.finish_s) == pytest.approx((1.02, 1.52, 1.54))
    assert b.tbt_s == pytest.approx(0.01)
    assert (b.ttft_s, b.queue_s, b.prefill_s) == pytest.approx((0.505, 0.005, 0.5))
    assert (a.prefill_id, a.decode_id, b.hit_tokens) == ("n0", "n0", 0)
    assert (inst.running, inst.kv_reserved, inst.outstanding_tokens) == (0, 0, 0)


def test_prefill_priority_and_token_budget():
    loop, inst = make(budget=600)
    recs = [submit_at(loop, inst, 0.0, i, n, 2) for i, n in enumerate((600, 400, 300))]
    loop.run()
    # the first prompt starts alone (0.6 s); 400 + 300 exceed the budget of 600, so they get
    # one prefill step each (prefill has priority over decoding request 0); then one decode step
    assert [r.first_token_s for r in recs] == pytest.approx([0.6, 1.0, 1.3])
    assert [r.finish_s for r in recs] == pytest.approx([1.31, 1.31, 1.31])
    assert recs[0].tbt_s == pytest.approx(0.71)


def test_waiting_prompts_share_a_prefill_step_within_the_budget():
    loop, inst = make(budget=1000)
    recs = [submit_at(loop, inst, 0.0, i, n, 2) for i, n in enumerate((600, 400, 300))]
    loop.run()
    assert [r.first_token_s for r in recs] == pytest.approx([0.6, 1.3, 1.3])


def test_chunked_prefill_mixes_decode_tokens_and_prompt_chunks():
    loop, inst = make(chunked=True, budget=300, seqs=4)
    a = submit_at(loop, inst, 0.0, 0, 500, 3)
    b = submit_at(loop, inst, 0.505, 1, 400, 2)
    loop.run()
    # A: chunks 300 + 200 -> first token 0.5; decode-only step to 0.51; then A's token rides
    # with B's 299-token chunk (0.299 + 0.01) to 0.819; B's last 101 tokens end at 0.92
    assert (a.first_token_s, a.finish_s, a.tbt_s) == pytest.approx((0.5, 0.819, 0.309))
    assert (b.prefill_start_s, b.first_token_s, b.finish_s) == pytest.approx((0.51, 0.92, 0.93))
    assert b.tbt_s == pytest.approx(0.01)
    assert inst.outstanding_tokens == 0 and not inst.prefilling


def test_prefill_gpu_time_is_shared_by_prompt_tokens():
    """A step's prefill time goes to its requests by the prompt tokens each computed (before,
    each request was charged its whole first-token wait, double-counting shared steps)."""
    loop, inst = make(budget=1000)
    recs = [submit_at(loop, inst, 0.0, i, n, 2) for i, n in enumerate((600, 400, 300))]
    loop.run()
    # steps: [600] 0.6 s; [400, 300] one step of 0.7 s shared 4:3
    assert [r.prefill_gpu_s for r in recs] == pytest.approx([0.6, 0.4, 0.3])
    loop, inst = make(chunked=True, budget=300, seqs=4)
    a = submit_at(loop, inst, 0.0, 0, 500, 3)
    b = submit_at(loop, inst, 0.505, 1, 400, 2)
    loop.run()
    # chunked: each chunk's prefill compute alone (the decode tokens it carries are not A's)
    assert (a.prefill_gpu_s, b.prefill_gpu_s) == pytest.approx((0.5, 0.4))


def test_prefix_cache_reuses_leading_blocks_and_always_recomputes_one_token():
    loop, inst = make(prefix=True)
    a = submit_at(loop, inst, 0.0, 0, 300, 2, (1, 2, 3))
    b = submit_at(loop, inst, 1.0, 1, 300, 2, (1, 2, 9))
    c = submit_at(loop, inst, 2.0, 2, 300, 2, (1, 2, 3))
    d = submit_at(loop, inst, 3.0, 3, 300, 2, (7, 2, 3))
    loop.run()
    assert [r.hit_tokens for r in (a, b, c, d)] == [0, 200, 299, 0]
    assert [r.prefill_s for r in (a, b, c, d)] == pytest.approx([0.3, 0.1, 0.001, 0.3])
    # LRU order, least recent first (blocks are touched/inserted from last to first)
    assert list(inst.cache) == [9, 1, 3, 2, 7]


def test_prefix_cache_is_lru_over_unreserved_hbm():
    loop, inst = make(capacity=500, prefix=True)
    submit_at(loop, inst, 0.0, 0, 200, 2, (1, 2))
    submit_at(loop, inst, 1.0, 1, 200, 2, (3, 4))
    submit_at(loop, inst, 2.0, 2, 200, 2, (5, 6))
    loop.run()
    # a running request reserves 202 tokens, leaving (500 - 202) // 100 = 2 cacheable blocks
    # (its own blocks are conservatively counted twice): each insert evicts the older pair
    assert list(inst.cache) == [6, 5]
    assert inst.cache_evictions == 4


def test_requests_wait_for_hbm_and_never_preempt():
    loop, inst = make(capacity=1000)
    a = submit_at(loop, inst, 0.0, 0, 600, 100)
    b = submit_at(loop, inst, 0.0, 1, 400, 100)  # 500 more tokens do not fit next to 700
    loop.run()
    assert a.finish_s == pytest.approx(0.6 + 99 * 0.01)
    assert b.prefill_start_s == pytest.approx(a.finish_s)
    with pytest.raises(ValueError, match="needs 1101 KV tokens"):
        inst.submit(CoupledJob(SimRequest(9, 0.0, 1000, 101, ()), RequestRecord(9, 0, 1000, 101)))


def test_single_token_outputs_finish_at_first_token():
    loop, inst = make()
    r = submit_at(loop, inst, 0.0, 0, 100, 1)
    loop.run()
    assert (r.first_token_s, r.finish_s, r.tbt_s) == pytest.approx((0.1, 0.1, 0.0))
    assert inst.kv_reserved == 0


def _pass_s(cost, parts, tokens, cached_slowdown=0.0):
    """By hand: linear layers l·b·n·d² at mfu · t/(t+256) over the pass's t tokens; half of
    Table 1's attention count l·a·d·(n² + 2nc) at attention_mfu (cached pairs × (1+slowdown))."""
    n, peak = cost.node, cost.node.gpus * cost.node.gpu_flops
    linear = sum(80 * 22 * k * 8192**2 for k, _ in parts) / (peak * n.mfu * tokens / (tokens + 256))
    attn = sum(80 * 4 * 8192 * (k * k + 2 * k * c * (1 + cached_slowdown)) for k, c in parts)
    return linear + 0.5 * attn / (peak * n.attention_mfu)


def test_roofline_step_formulas():
    cost = RooflineCostModel()
    cc = CoupledCost(cost)
    n = cost.node
    pre = _pass_s(cost, [(1000, 3000)], 1000) + n.chunk_overhead_s
    assert cc.prefill_step([(1000, 3000)]) == pytest.approx(pre, rel=1e-12)
    assert cc.decode_step(8, 50_000) == cost.decode_step_time(8, 50_000)
    # mixed: the pass also carries one token for each of the 8 decoding sequences
    pre_mixed = _pass_s(cost, [(1000, 3000)], 1008) + n.chunk_overhead_s
    mixed = max(cost.decode_step_time(8, 50_000 + 4000), pre_mixed)
    assert cc.mixed_step([(1000, 3000)], 8, 50_000) == pytest.approx(mixed, rel=1e-12)
    assert cc.mixed_step([], 8, 50_000) == cost.decode_step_time(8, 50_000)
    fake = CoupledCost(FakeCost())
    assert fake.mixed_step([(100, 0), (50, 10)], 3, 0) == pytest.approx(0.16)


def test_slow_cached_attention_only_slows_attention_over_earlier_kv():
    cost = RooflineCostModel()
    n = cost.node
    slow = CoupledCost(cost, cached_attention_efficiency=0.25)
    # no earlier KV: the same step as the default engine
    assert slow.prefill_step([(1000, 0)]) == CoupledCost(cost).prefill_step([(1000, 0)])
    # 1000 new tokens over 3000 cached: their attention to the 3000 costs 4× as much
    pre = _pass_s(cost, [(1000, 3000)], 1000, cached_slowdown=3.0) + n.chunk_overhead_s
    assert slow.prefill_step([(1000, 3000)]) == pytest.approx(pre, rel=1e-12)
    with pytest.raises(ConfigError, match="cached_attention_efficiency must be in"):
        CoupledCost(cost, cached_attention_efficiency=0.0)
    with pytest.raises(ConfigError, match="cached_attention_efficiency must be in"):
        VllmOptions(cached_attention_efficiency=1.5)


def test_register_variant_adds_a_named_system():
    register_variant("vllm_test_budget_1024",
                     VllmOptions(chunked_prefill=True, max_num_batched_tokens=1024))
    loop = EventLoop()
    system = SYSTEMS.get("vllm_test_budget_1024")(SystemContext(loop, FakeCost(), SimConfig()))
    assert isinstance(system, VllmSystem) and system.options.budget == 1024
    with pytest.raises(ValueError, match="'vllm_test_budget_1024' is already registered"):
        register_variant("vllm_test_budget_1024", VllmOptions())


def test_options_validation_and_variants():
    assert VllmOptions().budget == 131_072
    assert VllmOptions(chunked_prefill=True).budget == 512
    assert VARIANTS["vllm_prefix_caching"].prefix_caching
    with pytest.raises(ConfigError, match="must exceed max_num_seqs"):
        VllmOptions(chunked_prefill=True, max_num_batched_tokens=256)
    with pytest.raises(ConfigError, match="unknown vLLM variant 'vllm_x'"):
        simulate_vllm([SimRequest(0, 0.0, 10, 2, ())], SimConfig(), "vllm_x")


def test_system_routes_to_least_outstanding_work_and_rejects_oversized():
    loop = EventLoop()
    system = VllmSystem(SystemContext(loop, FakeCost(), SimConfig(prefill_nodes=2,
                                                                  decode_nodes=1)), VllmOptions())
    reqs = [SimRequest(0, 0.0, 900, 5, ()), SimRequest(1, 0.0, 800, 5, ()),
            SimRequest(2, 0.0, 100, 5, ()), SimRequest(3, 0.0, 50, 5, ()),
            SimRequest(4, 0.0, 9_999, 5, ())]
    recs = [RequestRecord(r.index, 0.0, r.input_tokens, r.output_tokens) for r in reqs]
    for r, rec in zip(reqs, recs, strict=True):
        system.on_arrival(r, rec)
    loop.run()
    assert [r.prefill_id for r in recs[:4]] == ["n0", "n1", "n2", "n2"]
    assert (recs[4].rejected, recs[4].reject_reason) == (RejectStage.ARRIVAL, "kv_capacity")
    assert set(system.load()) == {"prefill_queued", "prefill_outstanding_tokens",
                                  "decode_batch", "decode_load"}


def test_regression_on_a_slice_of_the_conversation_trace(conversation_trace):
    reqs = load_requests(conversation_trace, limit=300)
    config = SimConfig(prefill_nodes=2, decode_nodes=2)
    caps = {}
    for variant in VARIANTS:
        records = simulate_vllm(reqs, config, variant)
        assert len(records) == 300 and all(r.rejected is None for r in records)
        for r in records:
            assert r.arrival_s <= r.prefill_start_s < r.first_token_s <= r.finish_s
            assert not math.isnan(r.tbt_s) and r.hit_tokens < r.input_tokens
        caps[variant] = [effective_capacity(records, t) for t in (0.1, 0.2, 0.3)]
        hits = sum(r.hit_tokens for r in records)
        assert (hits > 0) == (variant == "vllm_prefix_caching")
    # 4 coupled instances are overloaded by this slice: prefill stalls hurt TBT, chunking helps
    assert caps["vllm"][0] < caps["vllm_chunked_prefill"][0]
    for c in caps.values():
        assert c == sorted(c)


@pytest.mark.slow
def test_whole_conversation_trace_on_16_instances(conversation_trace):
    """Whole trace at its own pace: every request served; chunked prefill's 512-token mixed
    steps (linear layers at 2/3 of a long pass's MFU: ≈ 100-150 ms) put many TBTs between 100
    and 200 ms, where it beats plain vLLM, whose whole-prompt prefills stall decoding for
    seconds; prefix caching finds local hits; each baseline simulates the hour-long trace well
    inside a minute."""
    import time

    reqs = load_requests(conversation_trace)
    caps, hits = {}, {}
    for variant in VARIANTS:
        t0 = time.perf_counter()
        records = simulate_vllm(reqs, SimConfig(), variant)
        assert time.perf_counter() - t0 < 60
        assert sum(r.rejected is not None for r in records) == 0
        caps[variant] = (effective_capacity(records, 0.1), effective_capacity(records, 0.2))
        hits[variant] = sum(r.hit_tokens for r in records) / sum(r.input_tokens for r in records)
    assert caps["vllm_chunked_prefill"][1] - caps["vllm_chunked_prefill"][0] > 0.2
    assert caps["vllm_chunked_prefill"][1] > caps["vllm"][1] + 0.1
    assert hits["vllm"] == 0.0 and 0.0 < hits["vllm_prefix_caching"] < 0.3
