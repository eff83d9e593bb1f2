"""Prefill selection on hand-built snapshots (see policy_factories for the round predictors)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
from policy_factories import PREDICTORS, config, decode, prefill, request, view

from yuebing.conductor.policy import Policy, PrefillGroup, PrefixSource, Route
from yuebing.core.errors import InputError
from yuebing.core.ids import InstanceId

# input 1000 tokens = 10 blocks of 100; prefill costs 1 ms per new token
FOUR = (prefill("p0", 0.5, local=0), prefill("p1", 0.2, local=2),
        prefill("p2", 0.3, local=6), prefill("p3", 0.1, local=0, queued=3))


def route(selector: str, v, **kw) -> Route:
    r = Policy(config(prefill_selector=selector, **kw), PREDICTORS).decide(request(), v)
    assert isinstance(r, Route)
    return r


def test_load_balance_picks_least_queued_work_and_reuses_its_local_prefix():
    r = route("load_balance", view(FOUR))
    assert (r.prefill_id, r.reused_blocks, r.fetch_from, r.fetch_blocks) == ("p3", 0, None, 0)
    assert r.est_queue_s == 0.1
    assert r.est_prefill_s == pytest.approx(1.0, rel=1e-12)
    assert r.est_ttft_s == pytest.approx(1.1, rel=1e-12)


def test_load_balance_ties_on_queue_go_to_fewer_requests_then_first_listed():
    v = view((prefill("a", 0.2, queued=5), prefill("b", 0.2, queued=1), prefill("c", 0.2, queued=1)))
    assert route("load_balance", v).prefill_id == "b"


def test_local_cache_aware_minimises_queue_plus_prefill_of_uncached_suffix():
    # ttft: p0 0.5+1.0, p1 0.2+0.8, p2 0.3+0.4, p3 0.1+1.0 -> p2
    r = route("local_cache_aware", view(FOUR))
    assert (r.prefill_id, r.reused_blocks, r.fetch_blocks) == ("p2", 6, 0)
    assert r.est_ttft_s == pytest.approx(0.7, rel=1e-12)


def test_global_cache_aware_fetches_best_prefix_and_charges_transfer():
    # best prefix 8 blocks on a store node; transfer 0.1 ms/token for the missing part.
    # p0: .08+.5+.2=.78  p1: .06+.2+.2=.46  p2: .02+.3+.2=.52  p3: .08+.1+.2=.38 -> p3
    v = view(FOUR, best_prefix=PrefixSource("store7", 8))
    r = route("global_cache_aware", v)
    assert (r.prefill_id, r.reused_blocks, r.fetch_from, r.fetch_blocks) == ("p3", 8, "store7", 8)
    assert r.est_transfer_s == pytest.approx(0.08, rel=1e-12)
    assert r.est_prefill_s == pytest.approx(0.2, rel=1e-12)
    assert r.est_ttft_s == pytest.approx(0.38, rel=1e-12)


@pytest.mark.parametrize(("best", "threshold", "expected"), [
    (6, 1.2, (5, None, 0, 0.5)),      # 6/5 == 1.2 is not > 1.2: use the local prefix
    (7, 1.2, (7, "h", 2, 0.32)),      # 7/5 = 1.4 > 1.2: fetch 2 blocks (0.02 s) + 0.3 s
    (6, 1.19, (6, "h", 1, 0.41)),     # 6/5 > 1.19: fetch 1 block (0.01 s) + 0.4 s
])
def test_algorithm1_balancing_threshold_boundary(best, threshold, expected):
    v = view((prefill("p0", 0.0, local=5),), best_prefix=PrefixSource("h", best))
    r = route("global_cache_aware", v, kvcache_balancing_threshold=threshold)
    assert (r.reused_blocks, r.fetch_from, r.fetch_blocks) == expected[:3]
    assert r.est_ttft_s == pytest.approx(expected[3], rel=1e-12)


def test_global_prefers_recompute_when_remote_gain_is_small():
    # 1 MB/s link: fetching costs 1 ms/token, the same as recomputing -> keep local prefix
    v = view((prefill("p0", 0.0, local=5),), best_prefix=PrefixSource("h", 10), bw=1e6)
    r = route("global_cache_aware", v)
    assert (r.reused_blocks, r.fetch_from, r.est_transfer_s) == (5, None, 0.0)
    # fast link but a required gain larger than the 0.45 s it would save
    v = view((prefill("p0", 0.0, local=5),), best_prefix=PrefixSource("h", 10))
    assert route("global_cache_aware", v, min_transfer_gain_s=0.46).fetch_from is None
    assert route("global_cache_aware", v, min_transfer_gain_s=0.44).fetch_from == "h"


def test_global_never_fetches_from_itself_and_equals_local_without_index():
    v = view((prefill("p0", 0.0, local=8), prefill("p1", 0.0)), best_prefix=PrefixSource("p0", 8))
    r = route("global_cache_aware", v)
    assert (r.prefill_id, r.reused_blocks, r.fetch_from) == ("p0", 8, None)
    assert route("global_cache_aware", view(FOUR)) == route("local_cache_aware", view(FOUR))


def test_fully_cached_input_still_recomputes_its_last_token():
    # 950 tokens -> 10 keys, the last block partial; holding all 10 covers 949 reusable tokens
    r = Policy(config(prefill_selector="local_cache_aware"), PREDICTORS).decide(
        request(950), view((prefill("p0", 0.25, local=10),)))
    assert (r.reused_blocks, r.est_prefill_s, r.est_ttft_s) == (10, 0.001, 0.251)


def test_random_is_a_stable_hash_of_seed_and_request_id():
    def expected(seed: int, rid: str) -> int:
        d = hashlib.blake2b(f"{seed}:prefill:{rid}".encode(), digest_size=8).digest()
        return int.from_bytes(d, "little") % 4

    pol = Policy(config(prefill_selector="random", seed=7), PREDICTORS)
    counts = [0, 0, 0, 0]
    for k in range(400):
        rid = f"req-{k}"
        r = pol.decide(request(rid=rid), view(FOUR))
        assert r.prefill_id == f"p{expected(7, rid)}"
        counts[int(r.prefill_id[1])] += 1
    assert min(counts) >= 70, counts  # roughly uniform
    other = Policy(config(prefill_selector="random", seed=8), PREDICTORS)
    assert any(other.decide(request(rid=f"req-{k}"), view(FOUR)).prefill_id
               != pol.decide(request(rid=f"req-{k}"), view(FOUR)).prefill_id for k in range(20))


def test_decode_choice_is_independent_of_prefill_selector():
    v = view(FOUR, decodes=(decode("d0", batch=3), decode("d1", batch=1)))
    assert {route(s, v).decode_id for s in ("random", "load_balance", "local_cache_aware",
                                             "global_cache_aware")} == {"d1"}


def test_long_prompts_are_estimated_as_chunked_pipeline_parallel():
    # threshold 300 new tokens, chunks of 100: k = ceil(new / 300) stages (≤ 4), each 1/k of the
    # layers plus (k-1)/chunks of bubble, starting when the k-1 least queued others are free too
    kw = dict(cpp_threshold_tokens=300, cpp_max_nodes=4, cpp_chunk_tokens=100)
    lb = route("load_balance", view(FOUR), **kw)  # p3, 1000 new: k=4, waits for p0 (0.5 s)
    assert (lb.prefill_id, lb.est_queue_s) == ("p3", 0.5)
    assert lb.est_prefill_s == pytest.approx(1.0 / 4 * (1 + 3 / 10), rel=1e-12)
    # p0 .5+.325, p1 max(.2,.3)+.8/3*1.25, p2 max(.3,.1)+.4/2*1.25 = .55, p3 .5+.325 -> p2
    local = route("local_cache_aware", view(FOUR), **kw)
    assert (local.prefill_id, local.est_queue_s) == ("p2", 0.3)
    assert local.est_prefill_s == pytest.approx(0.25, rel=1e-12)
    assert route("global_cache_aware", view(FOUR), **kw) == local
    small = route("local_cache_aware", view(FOUR), cpp_threshold_tokens=1000)
    assert small == route("local_cache_aware", view(FOUR))  # 1000 new tokens: not above


def _group(name: str, *queues: float) -> PrefillGroup:
    return PrefillGroup(InstanceId(name), tuple(prefill(f"{name}s{i}", q)
                                                for i, q in enumerate(queues)))


def test_declared_groups_take_long_prompts_when_their_estimate_is_lower():
    # 1000 new tokens, chunks of 250 (4), hand-off 250 tok x 4000 B / 10 MB/s = 0.1 s per
    # boundary: a group of 2 = 1.0 / 2 * (1 + 1/4) + 0.1 = 0.725 s after its slowest queue
    kw = dict(cpp_threshold_tokens=500, cpp_chunk_tokens=250, cpp_boundary_bytes_per_token=4000)
    v = view((prefill("p0", 0.2),), groups=(_group("g", 0.0, 0.1),))
    r = route("load_balance", v, **kw)
    assert (r.prefill_id, r.stages, r.est_queue_s) == ("g", ("gs0", "gs1"), 0.1)
    assert r.est_prefill_s == pytest.approx(0.725, rel=1e-12)
    # its slowest stage's queue counts: 0.5 + 0.725 s loses to the single's 0.2 + 1.0 s
    busy = view((prefill("p0", 0.2),), groups=(_group("g", 0.5, 0.0),))
    assert route("load_balance", busy, **kw).prefill_id == "p0"
    # a short prompt (400 new) goes to the single instance even though the group is idle
    short = Policy(config(prefill_selector="load_balance", **kw), PREDICTORS).decide(
        request(400), v)
    assert isinstance(short, Route) and (short.prefill_id, short.stages) == ("p0", ())
    # declared groups: the single instance's estimate is its own (no dynamic group)
    assert route("load_balance", view((prefill("p0", 0.2),), groups=(_group("g", 9, 9),)),
                 **kw).est_prefill_s == pytest.approx(1.0)


def test_a_view_of_groups_only_routes_every_prompt_to_a_group():
    v = view((), groups=(_group("g", 0.3, 0.0), _group("h", 0.0, 0.1)))
    for n in (50, 1000):
        r = Policy(config(cpp_threshold_tokens=500), PREDICTORS).decide(request(n), v)
        assert isinstance(r, Route) and r.prefill_id == "h" and r.stages == ("hs0", "hs1")
    assert Policy(config(), PREDICTORS).decide(request(50), view(())).reason == "no_instances"


def test_twins_take_short_prompts_only_while_their_group_is_idle():
    # a group of 2 stages with a whole-model twin on each stage's machine (also in prefills):
    # 1000 new tokens on the group: 1.0 / 2 * (1 + 1/4) + 0.1 = 0.725 s; threshold 500
    kw = dict(prefill_selector="load_balance", cpp_threshold_tokens=500, cpp_chunk_tokens=250,
              cpp_boundary_bytes_per_token=4000)
    pol = Policy(config(**kw), PREDICTORS)

    def group_view(stage_q: float, stage_n: int, twin_q: tuple[float, float]) -> object:
        twins = (prefill("t0", twin_q[0]), prefill("t1", twin_q[1]))
        g = PrefillGroup(InstanceId("g"), (prefill("gs0", stage_q, queued=stage_n),
                                           prefill("gs1", stage_q, queued=stage_n)), twins)
        return view(twins, groups=(g,))

    idle = group_view(0.0, 0, (0.0, 0.3))
    short = pol.decide(request(400), idle)
    assert isinstance(short, Route) and (short.prefill_id, short.stages) == ("t0", ())
    long = pol.decide(request(1000), idle)  # above the threshold: never a twin's
    assert isinstance(long, Route) and long.prefill_id == "g"
    # the twins' work holds the group up: it starts when t1's 0.3 s are through
    assert (long.est_queue_s, long.stages) == (0.3, ("gs0", "gs1"))
    # group work queued or running: the short prompt goes to the group, not to a twin
    for stage_q, stage_n in ((0.4, 1), (0.0, 1)):
        busy = pol.decide(request(400), group_view(stage_q, stage_n, (0.0, 0.0)))
        assert isinstance(busy, Route) and busy.prefill_id == "g", (stage_q, stage_n)
    # a twin's local prefix counts: 1000 tokens with 6 cached blocks leave 400 new
    cached = view((prefill("t0", 0.0, local=6), prefill("t1")), groups=(PrefillGroup(
        InstanceId("g"), (prefill("gs0"), prefill("gs1")), (prefill("t0"), prefill("t1"))),))
    r = pol.decide(request(1000), cached)
    assert isinstance(r, Route) and (r.prefill_id, r.reused_blocks) == ("t0", 6)


@pytest.mark.parametrize("selector", ["local_cache_aware", "global_cache_aware"])
def test_an_instance_on_lent_cores_is_predicted_at_their_speed(selector):
    """p0's idle host-mates lend it their cores (time factor 0.4): its 1.0 s prefill is
    predicted at 0.4 s, which beats p1's 0.2 s queue + 1.0 s; the route says which factor
    its estimate holds, and the estimate charges it."""
    v = view((replace(prefill("p0", 0.0), time_factor=0.4), prefill("p1", 0.2)))
    r = route(selector, v)
    assert (r.prefill_id, r.prefill_factor) == ("p0", 0.4)
    assert r.est_prefill_s == pytest.approx(0.4, rel=1e-12)
    # without the lent cores p0 takes its own 1.0 s and still wins, at its own speed
    plain = route(selector, view((prefill("p0", 0.0), prefill("p1", 0.2))))
    assert (plain.prefill_id, plain.prefill_factor) == ("p0", 1.0)
    assert plain.est_prefill_s == pytest.approx(1.0, rel=1e-12)
    # a queued instance with lent cores beats an idle one without: 0.3 + 0.4 < 1.0
    v = view((prefill("p0", 0.0), replace(prefill("p1", 0.3), time_factor=0.4)))
    r = route(selector, v)
    assert (r.prefill_id, r.est_ttft_s) == ("p1", pytest.approx(0.7, rel=1e-12))


def test_a_fetched_prefix_is_prefilled_at_the_instance_speed():
    # the best prefix (8 blocks) on a store node: 0.08 s fetch + 0.2 s prefill, at 0.5 on p0
    v = view((replace(prefill("p0", 0.0), time_factor=0.5),),
             best_prefix=PrefixSource("store7", 8))
    r = route("global_cache_aware", v)
    assert (r.fetch_blocks, r.est_prefill_s) == (8, pytest.approx(0.1, rel=1e-12))
    assert r.est_ttft_s == pytest.approx(0.18, rel=1e-12)


@pytest.mark.parametrize("selector", ["random", "load_balance", "local_cache_aware",
                                      "global_cache_aware"])
def test_engine_pages_past_the_local_blocks_count_as_cached(selector):
    # one instance: 2 blocks (200 tokens) + 150 tokens of engine pages = 350 cached of 1000
    v = view((replace(prefill("p0", 0.0, local=2), local_extra_tokens=150),))
    r = route(selector, v)
    assert r.reused_blocks == 2 and r.est_prefill_s == pytest.approx(0.65, rel=1e-12)
    # never the last token: 9 blocks + 200 extra covers the prompt, one token is recomputed
    v = view((replace(prefill("p0", 0.0, local=9), local_extra_tokens=200),))
    assert route(selector, v).est_prefill_s == pytest.approx(0.001, rel=1e-12)


def test_engine_pages_steer_cache_aware_choices_and_skip_a_fetch_they_cover():
    # p1 holds 2 blocks and pages to token 750; p2 holds 6 blocks (600): p1 wins locally
    v = view((replace(prefill("p1", 0.0, local=2), local_extra_tokens=550),
              prefill("p2", 0.0, local=6)))
    assert route("local_cache_aware", v).prefill_id == "p1"
    # the store's 7 blocks (700 tokens) are fewer than p1's 750: no fetch, p1's own prefix
    r = route("global_cache_aware", replace(v, best_prefix=PrefixSource("store", 7)))
    assert (r.prefill_id, r.fetch_blocks, r.est_transfer_s) == ("p1", 0, 0.0)
    assert r.est_prefill_s == pytest.approx(0.25, rel=1e-12)


def test_a_negative_page_extra_is_refused():
    with pytest.raises(InputError, match="local_extra_tokens"):
        route("random", view((replace(prefill("p0"), local_extra_tokens=-16),)))
