"""The simulator's policy wiring (`yuebing.sim.predict`) and the paper modules' set-ups:
exact values by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from yuebing.sim.hardware import RooflineCostModel
from yuebing.sim.paper import fig1, overload
from yuebing.sim.predict import decode_durations, policy_config
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest


def _requests() -> list[SimRequest]:
    return [SimRequest(i, float(i), 10_000, out, ()) for i, out in enumerate((100, 200, 300, 400))]


def test_policy_gets_the_simulators_pipeline_settings() -> None:
    cost = RooflineCostModel()
    cfg = policy_config(SimConfig(policy=sim_policy(cpp_threshold_tokens=32_768, cpp_max_nodes=3)),
                        cost,
                        _requests())
    assert (cfg.cpp_threshold_tokens, cfg.cpp_max_nodes, cfg.cpp_chunk_tokens) == (32_768, 3,
                                                                                    8192)


def test_decode_durations_use_a_full_decode_node_capped_by_the_tbt_slo() -> None:
    cost = RooflineCostModel()
    reqs = _requests()
    full = cost.decode_kv_capacity_tokens
    batch = math.floor(full / 10_125)  # mean context: input + mean output / 2 = 10,125
    step = cost.decode_step_time(batch, full)
    hbm = 8 * 2.039e12 * 0.445
    assert step == pytest.approx((140e9 + full * 327_680) / hbm + 0.0069 + batch * 0.0004,
                                 rel=1e-12)
    qs = np.quantile([100, 200, 300, 400], (np.arange(100) + 0.5) / 100)
    assert decode_durations(cost, reqs) == pytest.approx(tuple(qs * step), rel=1e-12)
    capped = decode_durations(cost, reqs, tbt_slo_s=0.05)
    assert capped == pytest.approx(tuple(qs * 0.05), rel=1e-12)
    assert policy_config(SimConfig(policy=sim_policy(tbt_slo_s=0.05)), cost, reqs).decode_durations_s == capped


def test_decode_durations_keep_the_tail_the_residual_life_forecast_weighs() -> None:
    """A request decoding now still decodes Δ later with E[max(0, D - Δ)] / E[D]; at Δ past
    most decodes only the tail counts, and the fixed distribution must keep it (ten deciles
    of 5-95 % were 27 % low at 25 s on the arXiv-like workload)."""
    outputs = [round(20 * 1.01**i) for i in range(400)]  # 20 ... 1,060 tokens, long tail
    reqs = [SimRequest(i, float(i), 1000, out, ()) for i, out in enumerate(outputs)]
    durations = np.array(decode_durations(RooflineCostModel(), reqs, tbt_slo_s=0.1))
    true = np.array(outputs) * 0.1

    def residual(d: np.ndarray, dt: float) -> float:
        return float(np.maximum(0.0, d - dt).mean() / d.mean())

    for dt in (30.0, 60.0, 80.0):  # ten deciles: 0 % / −10 % / −23 % here
        assert residual(durations, dt) == pytest.approx(residual(true, dt), rel=0.05)


def test_oscillation_std_swing_and_band_variance() -> None:
    square = overload.oscillation([0.0, 1.0, 0.0, 1.0])
    assert (square["std"], square["swing"]) == (0.5, 1.0)
    assert square["band_var"] == 0.0  # a 10 s period is outside the 20-300 s band
    assert overload.oscillation([0.25]) == {"std": 0.0, "swing": 0.0, "band_var": 0.0}
    t = np.arange(200) * 5.0  # 1000 s sampled every 5 s
    in_band = overload.oscillation(list(0.5 + np.sin(2 * np.pi * t / 100)))
    assert in_band["std"] == pytest.approx(math.sqrt(0.5), rel=1e-12)
    assert in_band["band_var"] == pytest.approx(0.5, rel=1e-12)  # all of its variance
    slow = overload.oscillation(list(np.sin(2 * np.pi * t / 1000)))
    assert slow["band_var"] == pytest.approx(0.0, abs=1e-20)  # one cycle per 1000 s: outside


def test_overload_and_figure1_setups() -> None:
    pred = overload.config("predictive_early_rejection")
    assert (pred.policy.decode_selector, pred.policy.admission, pred.speed) == (
        "forecast", "predictive_early_rejection", 2.0)
    assert overload.config("early_rejection").policy.decode_selector == "least_loaded"
    base = overload.config("baseline")
    assert (base.prefill_nodes, base.decode_nodes, base.policy.admission) == (8, 8, "none")
    assert base.prefill_reject and base.decode_reject
    # the early policies decide once, at arrival: no stage re-checks that waste a prefill
    for name in ("early_rejection", "predictive_early_rejection"):
        early = overload.config(name)
        assert not (early.prefill_reject or early.decode_reject)
    assert overload.config("baseline", nodes=(8, 2)).decode_nodes == 2
    f1 = fig1.config("vllm")
    assert (f1.speed, f1.prefill_nodes + f1.decode_nodes) == (fig1.SPEED, 16)
    assert fig1.config("mooncake", fast=True).limit == 2000


def test_figure1_speed_plot_from_details(tmp_path) -> None:
    row = {"100": 0.5, "200": 0.7, "300": 0.9}
    details = {"speed": fig1.SPEED,
               "by_speed": {"1": {name: row for name in fig1.SYSTEM_NAMES},
                            "2": {"mooncake": row, "vllm": None, "vllm_prefix_caching": row,
                                  "vllm_chunked_prefill": row}}}
    [path] = fig1.plot_details(details, tmp_path)
    assert path.name == "fig1_speed_sensitivity.png" and path.stat().st_size > 10_000
    assert fig1._percent(None, 100) != fig1._percent(None, 100)  # NaN for a missing system
    assert fig1._percent(row, 200) == 70.0


def test_arxiv_like_workload_has_the_papers_statistics(conversation_trace) -> None:
    """The overload workload: the conversation trace with the arXiv trace's mean input and
    output lengths (±1 %) and 23,000 requests an hour, prefix sharing kept."""
    trace = overload.arxiv_like(conversation_trace)
    reqs = trace.in_time_order()
    n = len(reqs)
    assert n == 12_031
    assert sum(r.input_length for r in reqs) / n == pytest.approx(7590, rel=0.01)
    assert sum(r.output_length for r in reqs) / n == pytest.approx(182, rel=0.01)
    span_h = (reqs[-1].timestamp - reqs[0].timestamp) / 3_600_000
    assert n / span_h == pytest.approx(23_000, rel=0.001)
    assert all(r.input_length > 0 and r.output_length > 0 for r in reqs)
    shared = sum(len(r.hash_ids) for r in reqs) - len({k for r in reqs for k in r.hash_ids})
    assert shared > 0.3 * sum(len(r.hash_ids) for r in reqs)


def test_long_context_workloads_have_the_arxiv_shapes() -> None:
    from yuebing.sim.paper import longctx

    fixed = longctx.workload("fixed_64k", rate=1.0, fast=True)
    assert len(fixed) == longctx.REQUESTS // 2
    assert {r.input_tokens for r in fixed} == {65536} and {r.output_tokens for r in fixed} == {512}
    assert fixed[0].block_keys[:64] == fixed[1].block_keys[:64]        # first half shared
    assert set(fixed[0].block_keys[64:]).isdisjoint(fixed[1].block_keys)
    summ = longctx.workload("arxiv_summarization", rate=1.0)
    assert {(r.input_tokens, r.output_tokens) for r in summ} == {(8088, 229)}
    assert len({k for r in summ for k in r.block_keys}) == sum(len(r.block_keys) for r in summ)
    leval = longctx.workload("l_eval", rate=1.0)
    assert len(leval) == 100 and {(r.input_tokens, r.output_tokens) for r in leval} == {
        (19019, 72)}
    distinct = len({k for r in leval for k in r.block_keys})
    assert distinct / sum(len(r.block_keys) for r in leval) < 0.2     # > 80 % of blocks shared
    # Poisson arrivals at the asked rate (mean gap 1 s, loosely)
    gaps = np.diff([r.arrival_s for r in leval])
    assert 0.7 < gaps.mean() < 1.3


def test_given_forecast_durations_replace_the_cost_models() -> None:
    """A live Conductor learns its decode durations; the simulator takes them as given
    (`SimConfig.forecast_durations_s`) instead of outputs × a loaded node's step."""
    cost, reqs = RooflineCostModel(), _requests()
    cfg = policy_config(SimConfig(forecast_durations_s=(0.5, 2.0, 4.0)), cost, reqs)
    assert cfg.decode_durations_s == (0.5, 2.0, 4.0)
    assert policy_config(SimConfig(), cost, reqs).decode_durations_s == decode_durations(
        cost, reqs, SimConfig().policy.tbt_slo_s)


@pytest.mark.parametrize("bad", [(0.0,), (1.0, -2.0), (math.nan,), (math.inf,)])
def test_forecast_durations_must_be_positive_seconds(bad: tuple[float, ...]) -> None:
    from yuebing.core.errors import ConfigError

    with pytest.raises(ConfigError, match="forecast_durations_s"):
        SimConfig(forecast_durations_s=bad)
