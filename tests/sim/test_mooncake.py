"""Small Mooncake clusters with exact outcomes (hand-computed from a linear cost model)."""

from __future__ import annotations

import pytest
from sim_fakes import LinearCost

from yuebing.conductor.policy.types import RejectStage
from yuebing.core.errors import ConfigError
from yuebing.sim.mooncake import ranked_keys
from yuebing.sim.runner import simulate
from yuebing.sim.system import POLICY_FLAGS, SimConfig, sim_policy
from yuebing.sim.workload import SimRequest


def _req(i: int, t: float, keys: list[int], n_in: int, n_out: int = 3) -> SimRequest:
    return SimRequest(i, t, n_in, n_out, tuple(keys))


def _config(**kw: object) -> SimConfig:
    """A 2P1D config; keywords naming `PolicyConfig` fields go to its policy."""
    policy = {k: kw.pop(k) for k in list(kw) if k in POLICY_FLAGS}
    base: dict[str, object] = {"prefill_nodes": 2, "decode_nodes": 1,
                               "policy": sim_policy(**policy)}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


def test_local_prefix_reuse_and_timings() -> None:
    reqs = [_req(0, 0.0, [1, 2, 3, 4], 2048), _req(1, 1.0, [1, 2, 3, 5], 2048, 2),
            _req(2, 10.0, [1, 2, 3, 6], 2048), _req(3, 20.0, [1, 2, 3, 4], 2048)]
    res = simulate(reqs, _config(), cost=LinearCost())
    r0, r1, r2, r3 = res.records
    assert (r0.prefill_id, r0.hit_tokens, r0.ttft_s) == ("p0", 0, pytest.approx(2.048))
    # p0 is busy (and has not stored R0's blocks yet): R1 goes to the idle p1
    assert (r1.prefill_id, r1.hit_tokens, r1.ttft_s) == ("p1", 0, pytest.approx(2.048))
    # both hold 3 leading blocks now; the first listed wins the tie
    assert (r2.prefill_id, r2.hit_tokens, r2.ttft_s) == ("p0", 1536, pytest.approx(0.512))
    # whole prompt cached on p0: one token is still computed for the first output token
    assert (r3.prefill_id, r3.hit_tokens, r3.ttft_s) == ("p0", 2047, pytest.approx(0.001))
    # the whole KV moves to the decode node after the prefill (Figure 14's transfer stage)
    assert r0.kv_ready_s == pytest.approx(2.048 + 2048 * 1000 / 1e9)
    assert r0.finish_s == pytest.approx(r0.kv_ready_s + 2 * 0.05)
    assert r0.tbt_s == pytest.approx(0.05 + 2048e-6)
    assert res.summary["completed"] == 4 and res.summary["rejected"] == 0


def test_global_cache_aware_fetches_a_remote_prefix_and_replicates_it() -> None:
    long_keys = list(range(100, 140))
    reqs = [_req(0, 0.0, [1, 2, 3, 4], 2048), _req(1, 3.0, long_keys, 20_000),
            _req(2, 4.0, [1, 2, 3, 4, 5], 2560)]
    res = simulate(reqs, _config(), cost=LinearCost())
    r2 = res.records[2]
    assert res.records[1].prefill_id == "p0"       # p0 is now busy until 23 s
    assert (r2.prefill_id, r2.fetched_tokens, r2.hit_tokens) == ("p1", 2048, 2048)
    assert r2.first_token_s == pytest.approx(4.0 + 2048 * 1000 / 1e9 + 0.512)
    assert r2.queue_s == pytest.approx(2048 * 1000 / 1e9)


def test_local_cache_aware_waits_for_the_busy_holder_instead() -> None:
    long_keys = list(range(100, 140))
    reqs = [_req(0, 0.0, [1, 2, 3, 4], 2048), _req(1, 3.0, long_keys, 20_000),
            _req(2, 4.0, [1, 2, 3, 4, 5], 2560)]
    res = simulate(reqs, _config(prefill_selector="local_cache_aware"), cost=LinearCost())
    r2 = res.records[2]
    # p1 recomputes everything (2.56 s) rather than queueing 19 s behind the long prompt
    assert (r2.prefill_id, r2.fetched_tokens, r2.hit_tokens) == ("p1", 0, 0)
    assert r2.ttft_s == pytest.approx(2.56)


def test_slo_admission_rejects_at_arrival_with_reason() -> None:
    reqs = [_req(0, 0.0, list(range(40)), 20_000), _req(1, 0.5, list(range(100, 140)), 20_000),
            _req(2, 25.0, list(range(200, 240)), 20_000)]
    res = simulate(reqs, _config(admission="slo", prefill_nodes=1), cost=LinearCost())
    r0, r1, r2 = res.records
    # r1 would queue 19.5 s behind r0 and then prefill for 20 s: 39.5 s > the 30 s TTFT SLO
    assert r1.rejected is RejectStage.ARRIVAL and r1.reject_reason == "ttft_slo"
    assert r0.rejected is None and r2.rejected is None and r2.ttft_s == pytest.approx(20.0)
    assert res.summary["rejected_by_reason"] == {"ttft_slo": 1}


def test_chunked_pipeline_parallel_spreads_a_long_prompt() -> None:
    reqs = [_req(0, 0.0, list(range(78)), 40_000)]
    res = simulate(reqs, _config(prefill_nodes=4, cpp_threshold_tokens=10_000, cpp_max_nodes=4),
                   cost=LinearCost())
    r = res.records[0]
    # 4 nodes, 5 chunks of 8192 tokens: 40 s / 4 · (1 + 3/5)
    assert r.ttft_s == pytest.approx(40.0 / 4 * (1 + 3 / 5))
    assert r.prefill_gpu_s == pytest.approx(4 * r.ttft_s)


def test_declared_pipeline_groups_take_long_prompts_when_they_finish_sooner() -> None:
    reqs = [_req(0, 0.0, list(range(78)), 40_000), _req(1, 1.0, [1, 2, 3, 4], 2048),
            _req(2, 2.0, list(range(200, 278)), 40_000)]
    res = simulate(reqs, _config(cpp_threshold_tokens=10_000, cpp_groups=1), cost=LinearCost())
    r0, r1, r2 = res.records
    # 2 stages, 5 chunks of 8192: 40 s / 2 · (1 + 1/5) = 24 s, against 40 s on one node
    assert (r0.prefill_id, r0.ttft_s) == ("g0", pytest.approx(24.0))
    assert r0.prefill_gpu_s == pytest.approx(48.0)
    assert r1.prefill_id == "p0"  # a short prompt: a single node
    # the group is busy until 24 s: 22 + 24 s there loses to 40 s on the idle p1
    assert (r2.prefill_id, r2.ttft_s) == ("p1", pytest.approx(40.0))


def test_a_group_with_twins_and_no_single_node_is_serve_s_cpp_cluster() -> None:
    """``serve --prefill 2 --cpp-group 2`` has no single instance: its twins take the short
    prompts, the group the long ones (``prefill_nodes=0`` with ``cpp_twins``); without twins
    a cluster needs a prefill node."""
    reqs = [_req(0, 0.0, list(range(78)), 40_000), _req(1, 30.0, [1, 2, 3, 4], 2048)]
    res = simulate(reqs, _config(prefill_nodes=0, cpp_threshold_tokens=10_000, cpp_groups=1,
                                 cpp_twins=True), cost=LinearCost())
    r0, r1 = res.records
    assert (r0.prefill_id, r0.ttft_s) == ("g0", pytest.approx(24.0))
    assert r1.prefill_id in ("g0t0", "g0t1") and r1.ttft_s == pytest.approx(2.048)
    with pytest.raises(ConfigError, match="prefill_nodes must be >= 1"):
        _config(prefill_nodes=0, cpp_groups=1)


def test_same_seed_same_result() -> None:
    reqs = [_req(i, i * 0.3, [i % 3, 10 + i], 1000, 5) for i in range(30)]
    a = simulate(reqs, _config(prefill_selector="random", seed=3), cost=LinearCost())
    b = simulate(reqs, _config(prefill_selector="random", seed=3), cost=LinearCost())
    assert [r.prefill_id for r in a.records] == [r.prefill_id for r in b.records]
    assert a.summary == b.summary


def test_decode_tail_slows_a_tenth_of_the_steps_per_seed() -> None:
    """``decode_tail``: off by default (even 50 ms steps, the paper-scale simulator as before);
    on, the paper TBT of long requests carries the tail, the same seed gives the same steps and
    another seed other ones."""
    reqs = [_req(i, i * 5.0, [i], 512, 61) for i in range(20)]  # one at a time, 60 steps
    even = simulate(reqs, _config(), cost=LinearCost())
    assert SimConfig().decode_tail == 1.0
    assert {round(r.tbt_s, 9) for r in even.records} == {round(0.05 + 512e-6 / 6, 9)}  # + KV move
    a = simulate(reqs, _config(decode_tail=3.0, seed=1), cost=LinearCost())
    b = simulate(reqs, _config(decode_tail=3.0, seed=1), cost=LinearCost())
    c = simulate(reqs, _config(decode_tail=3.0, seed=2), cost=LinearCost())
    assert [r.tbt_s for r in a.records] == [r.tbt_s for r in b.records]
    assert [r.finish_s for r in a.records] != [r.finish_s for r in c.records]
    tbt = [r.tbt_s for r in a.records]
    assert max(tbt) == pytest.approx(0.15, abs=1e-4)  # its slowest tenth all slow steps
    assert all(0.05 < t <= 0.15 + 1e-4 for t in tbt) and min(tbt) < 0.14
    assert a.extra["decode_iterations"] == b.extra["decode_iterations"]


def test_decode_stage_rejection_wastes_the_prefill() -> None:
    # decode KV holds 3000 tokens: the second request's 2048 + 3 cannot join beside the first
    reqs = [_req(0, 0.0, [1, 2, 3, 4], 2048, 50), _req(1, 0.1, [5, 6, 7, 8], 2048, 3)]
    res = simulate(reqs, _config(decode_reject=True), cost=LinearCost(capacity=3000))
    r0, r1 = res.records
    assert r0.rejected is None
    assert r1.rejected is RejectStage.DECODE and r1.reject_reason == "decode_kv_full"
    assert r1.prefill_gpu_s == pytest.approx(2.048)       # the prefill ran for nothing
    assert r1.first_token_s == pytest.approx(0.1 + 2.048)
    # without the flag it waits for room instead
    res = simulate(reqs, _config(), cost=LinearCost(capacity=3000))
    assert res.records[1].rejected is None
    assert res.records[1].decode_start_s == pytest.approx(res.records[0].finish_s)


def test_prefill_stage_rejection_when_the_ttft_slo_is_already_lost() -> None:
    reqs = [_req(0, 0.0, list(range(40)), 20_000), _req(1, 0.5, list(range(100, 140)), 20_000)]
    res = simulate(reqs, _config(prefill_nodes=1, prefill_reject=True), cost=LinearCost())
    r0, r1 = res.records
    assert r0.rejected is None
    assert r1.rejected is RejectStage.PREFILL and r1.reject_reason == "prefill_ttft_slo"
    assert r1.prefill_gpu_s == 0.0


def test_breakdown_adds_up_on_every_request() -> None:
    reqs = [_req(i, i * 0.7, [i % 4, 100 + i], 1000 + 37 * i, 2 + i % 9) for i in range(40)]
    res = simulate(reqs, _config(prefill_nodes=2, decode_nodes=2), cost=LinearCost(5000))
    for r in res.records:
        assert r.queue_s + r.prefill_s == pytest.approx(r.ttft_s)
        assert r.queue_s >= 0 and r.transfer_s >= 0 and r.decode_wait_s >= 0
        assert r.first_token_s <= r.kv_ready_s <= r.decode_start_s <= r.finish_s


def test_ranked_keys_pick_blocks_by_how_many_requests_use_them() -> None:
    reqs = [_req(0, 0.0, [1, 2, 3], 1536), _req(1, 1.0, [1, 2, 4], 1536),
            _req(2, 2.0, [1, 5], 1024)]
    # uses: 1 -> 3, 2 -> 2, then 3, 4, 5 once each (ties in first-use order)
    assert ranked_keys(reqs, (1, 2, 3, 5, 6)) == {1: 1, 2: 2, 3: 3, 5: 5}


def test_replicas_of_the_tenth_ranked_block_are_sampled() -> None:
    reqs = [_req(0, 0.0, list(range(1, 13)), 6144), _req(1, 10.0, [99], 512)]
    res = simulate(reqs, _config(sample_interval_s=2.0), cost=LinearCost())
    # 12 blocks used once: rank 10 is block 10, stored on p0 when the 6.144 s prefill ends
    assert res.extra["ranked_key_replicas"] == {"10": [0, 0, 0, 0, 1, 1]}  # every 2 s to 10 s


def test_decode_recheck_predicts_the_tbt_as_the_conductor_does(monkeypatch) -> None:
    """The decode node's TBT re-check uses the Conductor's decode predictor, not the cost model
    (the arrival checks use the predictor; a re-check by another estimate of the same step
    makes the two disagree at the SLO's edge)."""
    from yuebing.conductor.policy import DecodePredictor, Policy, Predictors
    from yuebing.sim import mooncake
    from yuebing.sim.predict import policy_config, predictors_for

    def slow_decode_policy(config, cost, requests):  # type: ignore[no-untyped-def]
        fitted = predictors_for(cost)
        slow = DecodePredictor.from_function(lambda b, c: 0.2 if b else 0.0, degree=1)
        return Policy(policy_config(config, cost, requests),
                      Predictors(fitted.prefill, slow, fitted.transfer, "test"))

    reqs = [_req(0, 0.0, [1, 2], 1000, 5)]
    # the cost model's step (50 ms) holds the 100 ms TBT SLO, the Conductor's predictor (200 ms)
    # does not: the re-check follows the predictor
    assert simulate(reqs, _config(decode_reject=True), cost=LinearCost()).records[0].rejected \
        is None
    monkeypatch.setattr(mooncake, "policy_for", slow_decode_policy)
    res = simulate(reqs, _config(decode_reject=True, sample_interval_s=0.5), cost=LinearCost())
    assert res.records[0].rejected is RejectStage.DECODE
    assert res.records[0].reject_reason == "decode_tbt_slo"


def test_decode_tbt_load_is_the_predicted_step_over_the_tbt_slo() -> None:
    # samples run until the last arrival (12 s); the first request decodes from 1 s to 21 s
    reqs = [_req(0, 0.0, [1, 2], 1000, 400), _req(1, 12.0, [3, 4], 1000, 3)]
    res = simulate(reqs, _config(decode_nodes=2, sample_interval_s=5.0), cost=LinearCost())
    loads = res.timeseries["decode_tbt_load"]
    # one busy node of two, 50 ms steps, 100 ms SLO: (0.5 + 0) / 2 while it decodes
    assert loads[0] == 0.0 and loads[1:3] == pytest.approx([0.25, 0.25], rel=0.02)


def test_a_busy_pipeline_group_counts_in_the_prefill_load() -> None:
    """Sampled at 1 s: only the group is prefilling (0 to 24 s); each of its 2 stages counts as
    a prefill instance with 23 s queued, the 2 idle single nodes with 0 (TTFT SLO 30 s)."""
    reqs = [_req(0, 0.0, list(range(78)), 40_000), _req(1, 2.0, [1], 10)]
    res = simulate(reqs, _config(cpp_threshold_tokens=10_000, cpp_groups=1,
                                 sample_interval_s=1.0), cost=LinearCost())
    assert res.records[0].prefill_id == "g0"
    ts = res.timeseries
    at = ts["t_s"].index(1.0)
    assert ts["prefill_load"][at] == pytest.approx(2 * 23.0 / 4 / 30.0)
    assert ts["prefill_queued"][at] == 1.0
