"""Decode selection, admission (SLO, early rejection, predictive) and input checks.

Decode step = 10 ms + 10 ms per sequence + 1 µs per context token; TBT SLO 100 ms; decode
durations are a fixed 10 s, so a request decoding now is still decoding Δ s later with
probability 1 - Δ/10.
"""

from __future__ import annotations

import math

import pytest
from policy_factories import PREDICTORS, config, decode, prefill, request, view

from yuebing.conductor.policy import (
    ClusterView,
    PendingDecode,
    Policy,
    PrefixSource,
    Reject,
    RejectReason,
    RejectStage,
    Route,
    decide,
    forecast_decode_load,
)
from yuebing.conductor.policy.decode import forecast_state
from yuebing.core.errors import ConfigError, InputError
from yuebing.core.ids import InstanceId

P0 = (prefill("p0", 0.0),)  # ttft 1.0 s for the default 1000-token request


def decide_with(v, **kw):
    return Policy(config(**kw), PREDICTORS).decide(request(), v)


def test_least_loaded_among_instances_within_tbt_slo_with_kv_room():
    decodes = (
        decode("d0", batch=5, ctx=10_000),                 # tbt .081, load .81
        decode("d1", batch=2, ctx=50_000, kv=95_000, cap=100_000),  # tbt .091, KV does not fit
        decode("d2", batch=8, ctx=10_000),                 # tbt .111 > SLO
        decode("d3", batch=3, ctx=3_000),                  # tbt .054, load .54
    )
    r = decide_with(view(P0, decodes))
    assert isinstance(r, Route)
    assert r.decode_id == "d3"
    assert r.est_tbt_s == pytest.approx(0.054, rel=1e-12)


def test_waiting_requests_count_toward_the_batch():
    busy = decode("d0", batch=1)
    busy = type(busy)(busy.instance_id, 1, 0, 0, 1_000_000, waiting_requests=4,
                      waiting_context_tokens=20_000)
    r = decide_with(view(P0, (busy, decode("d1", batch=4))))
    # d0: 6 seqs, 21000 ctx -> .091 ; d1: 5 seqs, 1000 ctx -> .061
    assert (r.decode_id, r.est_tbt_s) == ("d1", pytest.approx(0.061, rel=1e-12))


def test_fallbacks_when_no_instance_meets_the_slo():
    over = (decode("d0", batch=12), decode("d1", batch=9), decode("d2", batch=1, kv=999_500))
    assert decide_with(view(P0, over)).decode_id == "d1"  # KV fits, lowest load .111
    full = (decode("d0", batch=3, kv=999_950), decode("d1", batch=1, kv=999_990))
    assert decide_with(view(P0, full)).decode_id == "d0"  # nothing fits: least loaded


def test_admission_none_routes_even_when_overloaded():
    r = decide_with(view((prefill("p0", 100.0),), (decode("d0", batch=50),)))
    assert isinstance(r, Route) and r.est_ttft_s == pytest.approx(101.0)


def test_slo_rejects_ttft_with_retry_after_the_excess():
    r = decide_with(view((prefill("p0", 40.0),)), admission="slo")
    assert r == Reject("ttft_slo", RejectStage.ARRIVAL, pytest.approx(11.0), pytest.approx(41.0),
                       pytest.approx(0.021))
    small = decide_with(view((prefill("p0", 29.5),)), admission="slo")
    assert small.reason == RejectReason.TTFT_SLO and small.retry_after_s == 1.0  # min retry


def test_slo_rejects_tbt_with_retry_when_forecast_batch_has_shrunk():
    # batch 10 -> tbt .121; the forecast batch 10(1-w/10) needs w >= 3.1 s; probes 1, 2, 4 s
    r = decide_with(view(P0, (decode("d0", batch=10),)), admission="slo")
    assert (r.reason, r.stage, r.retry_after_s) == ("tbt_slo", RejectStage.ARRIVAL, 4.0)
    assert r.est_tbt_s == pytest.approx(0.121, rel=1e-12)


def test_slo_rejects_full_kv_and_unservable_requests():
    r = decide_with(view(P0, (decode("d0", batch=1, kv=999_000),)), admission="slo")
    assert (r.reason, r.retry_after_s) == ("kv_capacity", 1.0)
    huge = Policy(config(admission="slo"), PREDICTORS).decide(
        request(1000, output=2_000_000), view(P0))
    assert (huge.reason, huge.retry_after_s) == ("unservable", math.inf)


def test_slo_accepts_within_both_slos():
    assert isinstance(decide_with(view(P0, (decode("d0", batch=7),)), admission="slo"), Route)


def test_early_rejection_on_prefill_load():
    r = decide_with(view((prefill("p0", 44.0),)), admission="early_rejection")
    assert (r.reason, r.retry_after_s) == ("prefill_overload", pytest.approx(15.0))
    ok = decide_with(view((prefill("p0", 29.0),)), admission="early_rejection")
    assert isinstance(ok, Route)


# Scenario A: decode overloaded now (load 1.21) but the request reaches it after 6 s of
# prefill queue + prefill, when the forecast batch is 10 * 0.4 = 4 (load .61).
DRAINING = view((prefill("p0", 5.0),), (decode("d0", batch=10),))
# Scenario B: decode idle now, but 10 routed requests reach it 1 s from now and are still
# decoding when this request arrives at t+6 s (forecast batch 10, load 1.21).
FILLING = ClusterView(
    now_s=100.0, prefills=(prefill("p0", 5.0),), decodes=(decode("d0"),),
    link_bandwidth_Bps=1e7,
    pending_decodes=tuple(PendingDecode(101.0, 0, InstanceId("d0")) for _ in range(10)))


def test_early_rejection_uses_current_decode_load():
    r = decide_with(DRAINING, admission="early_rejection")
    assert (r.reason, r.retry_after_s) == ("decode_overload", 4.0)
    assert isinstance(decide_with(FILLING, admission="early_rejection"), Route)


# Scenario C: as A, but the prefill pool is idle and the request's own prefill takes 5 s: no
# arrivals queue behind it yet, so the batch of 10 drains to 5 by then (load .76).
DRAINING_IDLE = view((prefill("p0", 0.0),), (decode("d0", batch=10),))
LONG = request(5000)


def decide_long(v, **kw):
    return Policy(config(**kw), PREDICTORS).decide(LONG, v)


def test_predictive_early_rejection_forecasts_load_at_decode_arrival():
    assert isinstance(decide_long(DRAINING_IDLE, admission="predictive_early_rejection"), Route)
    assert decide_long(DRAINING_IDLE, admission="early_rejection").reason == "decode_overload"
    r = decide_with(FILLING, admission="predictive_early_rejection")
    # pending requests all finish 11 s from now; probes at 6+1, 6+2, 6+4, 6+8 s
    assert (r.reason, r.retry_after_s) == ("decode_overload", 8.0)


def test_predictive_holds_the_running_batch_while_the_prefill_pool_is_busy():
    """A: the prefill pool has work, so requests arriving after this one refill the batch during
    its decode; the 10 running requests are not forecast to drain (load 1.21, as now)."""
    r = decide_with(DRAINING, admission="predictive_early_rejection")
    assert (r.reason, r.est_tbt_s) == ("decode_overload", pytest.approx(0.121))
    pol = Policy(config(), PREDICTORS)
    route = decide_with(DRAINING, decode_selector="forecast")
    assert route.est_step_s == pytest.approx(0.121)  # the step the route predicts
    assert forecast_decode_load(pol, request(), DRAINING, 106.0) == pytest.approx(0.61)  # retry


def test_without_forecast_hold_predictive_drains_the_running_batch_as_arxiv_7_4():
    """A again with ``forecast_hold`` off (the paper report's overload runs): the batch of 10
    is forecast to drain to 4 by the time the request reaches decode (load .61), admitted."""
    assert isinstance(decide_with(DRAINING, admission="predictive_early_rejection",
                                  forecast_hold=False), Route)
    route = decide_with(DRAINING, decode_selector="forecast", forecast_hold=False)
    assert route.est_step_s == pytest.approx(0.061)


def refilling(routed: int) -> ClusterView:
    """6 decoding, ``routed`` requests still in prefill reaching decode 1 s from now; this
    request reaches it after 6 s (prefill busy), when 6 · (1 - 0.6) = 2.4 of the 6 still run."""
    return ClusterView(
        now_s=100.0, prefills=(prefill("p0", 5.0),), decodes=(decode("d0", batch=6),),
        link_bandwidth_Bps=1e7,
        pending_decodes=tuple(PendingDecode(101.0, 0, InstanceId("d0")) for _ in range(routed)))


def test_held_batch_is_refilled_by_the_routed_prefills_not_added_to():
    """The bug it guards: the held batch of 6 plus 3 routed prefills (10 with this request,
    load 1.11, rejected) counted twice the slots of the 3.6 decodes ending first; the routed
    ones refill them, so the batch stays 6 (7 with this one, step .081, admitted)."""
    r = decide_with(refilling(3), admission="predictive_early_rejection",
                    decode_selector="forecast")
    assert isinstance(r, Route) and r.est_step_s == pytest.approx(0.081)
    # routed beyond the ending decodes still add: 2.4 + 6 = 8.4 (9.4 with it, step .105)
    r = decide_with(refilling(6), admission="predictive_early_rejection",
                    decode_selector="forecast")
    assert (r.reason, r.est_tbt_s) == ("decode_overload", pytest.approx(0.105))


@pytest.mark.parametrize("queue_s", [0.5, 2.0, 5.0, 10.0, 20.0])
def test_a_longer_prefill_queue_never_lightens_the_predicted_decode_load(queue_s):
    """The bug it guards: decaying the running batch over the prefill wait made the forecast
    lighter the longer the queue, so the predictive policy admitted most while overloaded."""
    v = view((prefill("p0", queue_s),), (decode("d0", batch=8, ctx=1000),))  # step .102 now
    r = decide_with(v, admission="predictive_early_rejection", decode_selector="forecast")
    assert (r.reason, r.est_tbt_s) == ("decode_overload", pytest.approx(0.102))


def test_forecast_values():
    pol = Policy(config(decode_durations_s=(10.0,)), PREDICTORS)
    assert forecast_decode_load(pol, request(), DRAINING, 106.0) == pytest.approx(0.61)
    assert forecast_decode_load(pol, request(), FILLING, 106.0) == pytest.approx(1.21)
    assert forecast_decode_load(pol, request(), FILLING, 100.5) == pytest.approx(0.21)
    # unassigned pending requests are spread evenly over the decode instances
    spread = ClusterView(100.0, FILLING.prefills, (decode("d0"), decode("d1")),
                         pending_decodes=tuple(PendingDecode(101.0, 0) for _ in range(10)))
    assert forecast_decode_load(pol, request(), spread, 106.0) == pytest.approx(0.71)


def test_survival_of_a_duration_distribution():
    pol = Policy(config(decode_durations_s=(2.0, 4.0, 6.0, 8.0)), PREDICTORS)
    assert [pol.survival(t) for t in (0.0, 2.0, 5.0, 8.0)] == [1.0, 0.75, 0.5, 0.0]
    # E[max(0, D-3)] = (0+1+3+5)/4 = 2.25, E[D] = 5
    assert pol.residual_survival(3.0) == pytest.approx(0.45, rel=1e-12)
    assert pol.residual_survival(0.0) == 1.0 and pol.residual_survival(9.0) == 0.0


def test_no_instances_rejects_and_decide_matches_policy():
    r = decide(request(), view((), None), config(), PREDICTORS)
    assert (r.reason, r.stage) == ("no_instances", RejectStage.ARRIVAL)
    v = view(P0, best_prefix=PrefixSource("x", 3))
    assert decide(request(), v, config(), PREDICTORS) == Policy(config(), PREDICTORS).decide(
        request(), v)


@pytest.mark.parametrize(("bad_view", "message"), [
    (view((prefill("p0", 0.0, local=11),)), "prefill p0: local_prefix_blocks must be in 0..10"),
    (view((prefill("p0", -1.0),)), "queue_s"),
    (view(P0, (decode("d0", cap=0),)), "decode d0: kv_capacity_tokens"),
    (view(P0, best_prefix=PrefixSource("h", 12)), "best_prefix.blocks must be in 0..10"),
    (view(P0, bw=0.0), "link_bandwidth_Bps > 0"),
])
def test_bad_views_raise_precise_errors(bad_view, message):
    with pytest.raises(InputError, match=message):
        Policy(config(), PREDICTORS).decide(request(), bad_view)


def test_bad_requests_and_configs():
    pol = Policy(config(), PREDICTORS)
    r = request()
    with pytest.raises(InputError, match="12 block keys of 100 tokens cannot come from 1000"):
        pol.decide(type(r)("r", 0.0, 1000, tuple(range(12)), 5), view(P0))
    with pytest.raises(InputError, match="input_tokens must be ≥ 1"):
        pol.decide(type(r)("r", 0.0, 0, (), 5), view(P0))
    for kw, msg in [({"prefill_selector": "nope"}, "prefill_selector 'nope' unknown"),
                    ({"kvcache_balancing_threshold": 0.5}, "kvcache_balancing_threshold"),
                    ({"tbt_slo_s": 0.0}, "tbt_slo_s must be a positive"),
                    ({"decode_durations_s": ()}, "decode_durations_s"),
                    ({"block_tokens": 0}, "block_tokens must be ≥ 1")]:
        with pytest.raises(ConfigError, match=msg):
            config(**kw)


def test_least_loaded_counts_routed_requests_still_in_prefill():
    # both idle now, but three requests already routed to d0 will arrive: avoid herding
    v = ClusterView(100.0, P0, (decode("d0"), decode("d1")), link_bandwidth_Bps=1e7,
                    pending_decodes=tuple(PendingDecode(101.0, 100, InstanceId("d0"), 1000)
                                          for _ in range(3)))
    r = decide_with(v)
    assert (r.decode_id, r.est_tbt_s) == ("d1", pytest.approx(0.021, rel=1e-12))
    assert decide_with(view(P0, (decode("d0"), decode("d1")))).decode_id == "d0"


def test_forecast_selector_picks_the_instance_that_will_be_least_loaded():
    # idle prefill pool, a 5 s prefill: at t+5 s d0's batch 10 drains to 5; d1's 4 drain to 2
    # but 5 routed ones join -> 7
    v = ClusterView(100.0, (prefill("p0", 0.0),), (decode("d0", batch=10), decode("d1", batch=4)),
                    link_bandwidth_Bps=1e7,
                    pending_decodes=tuple(PendingDecode(100.5, 0, InstanceId("d1"))
                                          for _ in range(5)))
    assert decide_long(v).decode_id == "d1"  # now: d0 10, d1 4 + 5 = 9
    r = decide_long(v, decode_selector="forecast", admission="predictive_early_rejection")
    assert (r.decode_id, r.est_tbt_s) == ("d0", pytest.approx(0.075, rel=1e-12))
    # with prefill work queued the running batches are held: d0 10, d1 4 + 5 -> d1
    busy = ClusterView(100.0, (prefill("p0", 0.1),), v.decodes, link_bandwidth_Bps=1e7,
                       pending_decodes=v.pending_decodes)
    assert decide_long(busy, decode_selector="forecast").decode_id == "d1"


def test_policy_config_cli_flags_round_trip():
    import argparse

    from yuebing.core.config import add_config_args, config_from_args

    parser = argparse.ArgumentParser()
    add_config_args(parser, type(config()), prefix="policy_")
    ns = parser.parse_args(["--policy-admission", "slo", "--policy-decode-durations-s", "5,10",
                            "--policy-kvcache-balancing-threshold", "1.5"])
    cfg = config_from_args(type(config()), ns, prefix="policy_")
    assert (cfg.admission, cfg.decode_durations_s, cfg.kvcache_balancing_threshold) == (
        "slo", (5.0, 10.0), 1.5)
    bad = parser.parse_args(["--policy-decode-selector", "fastest"])
    with pytest.raises(ConfigError, match="decode_selector 'fastest' unknown; use one of "
                                          "forecast, least_loaded, random"):
        config_from_args(type(config()), bad, prefix="policy_")


def test_tbt_tail_scales_the_step_while_the_prefill_pool_is_busy():
    """A step of 8 at 1000 context tokens takes 91 ms: with a tail of 1.5 and a prefill busy
    for another 0.5 s, the predicted paper TBT is 136.5 ms, over the 100 ms SLO."""
    busy = view((prefill("p0", 0.5),), (decode("d0", batch=7),))
    assert isinstance(decide_with(busy, admission="slo"), Route)
    r = decide_with(busy, admission="slo", tbt_tail=1.5)
    assert r.reason == "tbt_slo" and r.est_tbt_s == pytest.approx(0.1365)
    r = decide_with(busy, admission="early_rejection", tbt_tail=1.5)
    assert r.reason == "decode_overload" and math.isfinite(r.retry_after_s)
    route = decide_with(busy, tbt_tail=1.5)
    assert (route.est_tbt_s, route.est_step_s) == (pytest.approx(0.1365), pytest.approx(0.091))
    assert route.prefill_busy and decide_with(busy).prefill_busy  # known with or without a tail


def test_tbt_tail_is_off_while_the_prefill_pool_is_idle():
    """An idle prefill pool: the request's own TBT meets no prefill passes, so it is predicted
    without the tail, and a drained cluster (nothing decoding) is never held in rejection."""
    idle = view(P0, (decode("d0", batch=7),))
    r = decide_with(idle, admission="early_rejection", tbt_tail=4.0)
    assert r.est_tbt_s == pytest.approx(0.091)  # own TBT: no tail (it is rejected for others')
    route = Policy(config(admission="early_rejection", tbt_tail=4.0), PREDICTORS).decide(
        request(20), idle)  # a 20 ms prefill stretches 2 % of the running tenth
    assert isinstance(route, Route) and route.est_tbt_s == pytest.approx(0.09002)
    assert not route.prefill_busy  # the Conductor learns no tail from it
    drained = view(P0, (decode("d0"),))
    assert isinstance(decide_with(drained, admission="early_rejection", tbt_tail=4.0), Route)


# Running decodes beside a new prefill: batch 7 steps 80 ms; a tail of 2; decode durations
# 10 s, so the paper TBT's longest tenth is 1 s of intervals.
RUNNING_IDLE_POOL = view(P0, (decode("d0", batch=7),))


@pytest.mark.parametrize("admission", ["early_rejection", "predictive_early_rejection"])
def test_a_prefill_that_would_push_the_running_decodes_over_the_slo_is_rejected(admission):
    """The 1,000-token request's own TBT holds (91 ms, pool idle), but its 1 s prefill covers
    the running requests' whole longest tenth: 80 ms x 2 = 160 ms, over the SLO. Retry when
    the draining batch (7 x (1 - t/10)) takes it: probes 1, 2, 4 s (4.2: 104 ms), 8 s (48 ms)."""
    r = decide_with(RUNNING_IDLE_POOL, admission=admission, tbt_tail=2.0)
    assert (r.reason, r.est_tbt_s) == ("running_tbt", pytest.approx(0.091))
    assert r.retry_after_s == 8.0
    assert isinstance(decide_with(RUNNING_IDLE_POOL, admission="none", tbt_tail=2.0), Route)


@pytest.mark.parametrize("tokens, admitted", [(250, True), (300, False)])
def test_the_running_decodes_take_the_prefills_share_of_their_longest_tenth(tokens, admitted):
    """A 0.25 s prefill covers a quarter of the 1 s tenth: tail 1 + 1 x 0.25, 80 ms -> 100 ms,
    at the SLO (admitted); 0.3 s -> 104 ms (rejected)."""
    pol = Policy(config(admission="early_rejection", tbt_tail=2.0), PREDICTORS)
    assert pol.prefill_tail(RUNNING_IDLE_POOL, tokens / 1000) == pytest.approx(1 + tokens / 1000)
    r = pol.decide(request(tokens), RUNNING_IDLE_POOL)
    assert isinstance(r, Route) if admitted else r.reason == "running_tbt"


def test_prefill_tail_is_the_whole_tail_while_the_pool_is_busy():
    busy = view((prefill("p0", 0.5),), (decode("d0", batch=7),))
    assert Policy(config(tbt_tail=2.0), PREDICTORS).prefill_tail(busy, 0.01) == 2.0
    assert Policy(config(), PREDICTORS).prefill_tail(RUNNING_IDLE_POOL, 5.0) == 1.0


@pytest.mark.parametrize("tail", [0.5, math.nan, math.inf])
def test_tbt_tail_below_one_or_not_finite_is_refused(tail):
    with pytest.raises(ConfigError, match="tbt_tail"):
        config(tbt_tail=tail)


def test_running_decodes_are_protected_on_every_decode_instance_not_only_the_chosen_one():
    """The request goes to the idle d1, but its prefill shares the host's cores with d0's 7
    running requests too: 80 ms x 2 = 160 ms there, so it is rejected."""
    two = view(P0, (decode("d0", batch=7), decode("d1")))
    r = decide_with(two, admission="early_rejection", tbt_tail=2.0)
    assert r.reason == "running_tbt"


@pytest.mark.parametrize("admission", ["early_rejection", "predictive_early_rejection"])
def test_without_a_tail_an_overloaded_instance_does_not_block_prefills_for_another(admission):
    """Tail 1: a prefill does not stretch d0's steps (12 running: 142 ms, over the SLO), so
    rejecting a request bound for the idle d1 would protect nobody: it is admitted there. With
    a tail of 2 its prefill would stretch d0 further, and it is rejected."""
    two = view(P0, (decode("d0", batch=12), decode("d1")))
    r = decide_with(two, admission=admission)
    assert isinstance(r, Route) and r.decode_id == "d1"
    assert decide_with(two, admission=admission, tbt_tail=2.0).reason == "running_tbt"


def test_running_decodes_that_no_admission_can_protect_do_not_block_every_prefill():
    """With a tail of 6 one running request alone steps 20 ms x 6 = 120 ms beside any
    prefill: rejecting this request would not bring it within the SLO, so it is admitted
    (with 5, 100 ms, protecting the batch of 7 still rejects)."""
    assert isinstance(decide_with(RUNNING_IDLE_POOL, admission="early_rejection",
                                  tbt_tail=6.0), Route)
    r = decide_with(RUNNING_IDLE_POOL, admission="early_rejection", tbt_tail=5.0)
    assert r.reason == "running_tbt"


def test_the_hold_keeps_each_instance_at_its_state_of_now_or_its_forecast_as_a_whole():
    """Per instance: pending requests routed to d1 do not hold d0 up or down; d0, whose
    forecast (2.4 of 6 still running at +6 s) is below now, keeps its batch, context and KV of
    now; where the routed requests outnumber the ending decodes the forecast is taken whole, its
    context that of the requests it counts (review: each of the three was floored apart,
    pairing a refilled batch with the context of now)."""
    pol = Policy(config(), PREDICTORS)

    def at(pending: tuple[PendingDecode, ...]) -> ClusterView:
        return ClusterView(now_s=100.0, prefills=(prefill("p0", 5.0),),
                           decodes=(decode("d0", batch=6, ctx=6_000), decode("d1")),
                           link_bandwidth_Bps=1e7, pending_decodes=pending)

    to_d1 = tuple(PendingDecode(101.0, 0, InstanceId("d1")) for _ in range(3))
    batch, ctx, kv = forecast_state(pol, at(to_d1), 106.0, hold=True)
    assert (batch, ctx, kv) == ([6, 3.0], [6_000, 0.0], [6_000, 0.0])
    decayed = forecast_state(pol, at(to_d1), 106.0)
    assert decayed[0] == pytest.approx([2.4, 3.0]) and decayed[1] == pytest.approx([2_400, 0])
    to_d0 = tuple(PendingDecode(101.0, 0, InstanceId("d0")) for _ in range(6))
    batch, ctx, _ = forecast_state(pol, at(to_d0), 106.0, hold=True)
    assert batch == pytest.approx([8.4, 0.0]) and ctx == pytest.approx([2_400, 0.0])
