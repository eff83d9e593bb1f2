"""Prefill queue orders (`yuebing.conductor.policy.queue`): the rules, their starvation bounds,
the queue wait the policy estimates under each, and the flag's validation."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from policy_factories import PREDICTORS, config, prefill, request, view

from yuebing.conductor.policy import (
    PREFILL_QUEUES,
    ClusterView,
    Policy,
    PolicyConfig,
    QueuedPrefill,
    QueueOrder,
    Route,
)
from yuebing.core.errors import ConfigError, InputError


def _item(rid: str, arrival: float, prefill_s: float, slo: float = 10.0) -> QueuedPrefill:
    return QueuedPrefill(rid, arrival, prefill_s, arrival + slo)


def _order(name: str, aging: float = 0.1, slo: float = 10.0) -> QueueOrder:
    return PREFILL_QUEUES.get(name)(aging, slo)


def test_orders_rank_as_documented() -> None:
    items = [_item("long", 0.0, 8.0), _item("mid", 1.0, 3.0), _item("short", 2.0, 0.5)]
    assert _order("fifo").order(items, 5.0) == [0, 1, 2]
    # sjf_aging: prefill_s + 0.1·arrival → 8.0, 3.1, 0.7
    assert _order("sjf_aging").order(items, 5.0) == [2, 1, 0]
    # edf at 5 s: "long" (due 10 s) cannot finish by then (5 + 8 > 10): set aside, due 20 s
    assert _order("edf").order(items, 5.0) == [1, 2, 0]
    # at 1 s it could (9 s), but "mid" would then end at 12 s, past its 11 s: the longest goes
    assert _order("edf").order(items, 1.0) == [1, 2, 0]
    relaxed = [_item(i.request_id, i.arrival_s, i.prefill_s, slo=30.0) for i in items]
    assert _order("edf").order(relaxed, 1.0) == [0, 1, 2]  # all make it: arrival order
    # sjf_slack at 0 s: all three make it in deadline order (8, 11, 11.5 s); "short" first would
    # end "long" at 11.5 s, "mid" first at 11 s, past its 10 s: nobody overtakes it
    assert _order("sjf_slack").order(items, 0.0) == [0, 1, 2]
    assert _order("sjf_aging").order(items, 0.0) == [2, 1, 0]
    # at 5 s "long" is late whatever comes first: shortest first, as sjf_aging
    assert _order("sjf_slack").order(items, 5.0) == [2, 1, 0]
    # the estimate starts when the instance is free: "long" makes it from now, not from 5 s
    long_, new = items[0], _item("new", 0.0, 1.0)
    assert _order("edf").ahead_s([long_], new, 0.0) == 8.0
    assert _order("edf").ahead_s([long_], new, 0.0, start_s=5.0) == 0.0
    assert _order("sjf_aging").first(items, 5.0) == 2 and _order("edf").first(items, 5.0) == 1
    # ties go to the request queued first
    twins = [_item("a", 0.0, 1.0), _item("b", 0.0, 1.0)]
    assert [_order(n).first(twins, 0.0) for n in PREFILL_QUEUES] == [0, 0, 0, 0]


def test_ageing_lets_a_long_wait_go_before_a_newer_short_one() -> None:
    sjf = _order("sjf_aging", aging=0.5)
    old_long = _item("long", 0.0, 4.0)
    # only requests arriving within 4.0 / 0.5 = 8 s after the long one go before it
    assert sjf.first([old_long, _item("short", 7.0, 0.1)], 9.0) == 1  # 0.1 + 0.5·7 < 4.0
    assert sjf.first([old_long, _item("short", 9.0, 0.1)], 9.0) == 0  # 0.1 + 0.5·9 > 4.0


def _served_at(order: QueueOrder, arrivals: list[QueuedPrefill]) -> dict[str, float]:
    """One server, no preemption: when each request starts (arrivals sorted by time)."""
    pending = list(arrivals)
    queue: list[QueuedPrefill] = []
    now, start = 0.0, {}
    while pending or queue:
        while pending and pending[0].arrival_s <= now:
            queue.append(pending.pop(0))
        if not queue:
            now = pending[0].arrival_s
            continue
        item = queue.pop(order.first(queue, now))
        start[item.request_id] = now
        now += item.prefill_s
    return start


@pytest.mark.parametrize("name, bound_s", [
    # overtaken only by requests arriving within prefill_s / aging = 8 / 0.1 = 80 s after it:
    # 1 s of work every 0.5 s → at most 161 requests of 1 s, plus the one running
    ("sjf_aging", 1.0 + 161.0),
    # overtaken only by requests arriving within one SLO (10 s) after it: ≤ 21 + 1 of 1 s
    ("edf", 22.0),
    # on time when it is queued (8 s of work behind ≤ 1 s, due in 10 s): it stays on time
    ("sjf_slack", 10.0 - 8.0),
])
def test_a_long_prompt_under_a_stream_of_short_ones_does_not_starve(name: str,
                                                                    bound_s: float) -> None:
    """Short prompts alone overload the server (1 s of work every 0.5 s, for 500 s): pure
    shortest-first would serve the long one only when the stream ends."""
    shorts = [_item(f"s{k}", 0.25 + 0.5 * k, 1.0) for k in range(1000)]
    stream = [shorts[0], _item("long", 0.3, 8.0), *shorts[1:]]
    waited = _served_at(_order(name), stream)["long"] - 0.3
    assert waited <= bound_s
    pure_sjf = _served_at(_order("sjf_aging", aging=1e-9), stream)["long"] - 0.3
    assert pure_sjf > 900.0  # after every short one


def _stream(seed: int, n: int = 400) -> list[QueuedPrefill]:
    """Poisson arrivals at 1.5× one server's capacity, prefills of 0.2-4 s, TTFT SLO 10 s."""
    rng = random.Random(seed)
    sizes = (0.2, 0.5, 1.0, 2.0, 4.0)
    t, out = 0.0, []
    for k in range(n):
        t += rng.expovariate(1.5 / (sum(sizes) / len(sizes)))
        out.append(_item(f"r{k}", t, rng.choice(sizes)))
    return out


def _admitted_late(order: QueueOrder, arrivals: list[QueuedPrefill]) -> tuple[int, int]:
    """(admitted, admitted but late) on one server when each request is admitted only if the
    order's wait estimate (`QueueOrder.ahead_s`, exact prefills) ends it by its deadline."""
    pending, queue = list(arrivals), []
    now = free = 0.0
    admitted = late = 0
    while pending or queue:
        if pending and (not queue or pending[0].arrival_s <= free):
            new = pending.pop(0)
            now = new.arrival_s
            start = max(now, free)
            if start + order.ahead_s(queue, new, now, start) + new.prefill_s <= new.deadline_s:
                queue.append(new)
                admitted += 1
            continue
        now = free = max(free, now)
        item = queue.pop(order.first(queue, now))
        free = now + item.prefill_s
        late += free > item.deadline_s
    return admitted, late


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_request_admitted_on_time_is_not_made_late_by_later_ones(seed: int) -> None:
    """The admission promise (early rejection): what the estimate says is on time stays on
    time under sjf_slack; under sjf_aging later short requests overtake admitted ones."""
    stream = _stream(seed)
    admitted, late = _admitted_late(_order("sjf_slack"), stream)
    assert admitted > 150 and late == 0
    assert _admitted_late(_order("sjf_aging"), stream)[1] > 0


@pytest.mark.parametrize("seed", range(20))
def test_sjf_slack_keeps_on_time_whom_the_deadline_order_would(seed: int) -> None:
    """Random queues within one SLO: every request the deadline order (FIFO here) would serve
    on time is on time in sjf_slack's order; first() is order()[0], and ahead_s() is the work
    order() puts before the new request."""
    rng = random.Random(seed)
    items = [_item(f"q{k}", rng.uniform(0.0, 9.0), rng.choice((0.2, 0.5, 1.0, 2.0, 4.0)))
             for k in range(rng.randint(1, 12))]
    items.sort(key=lambda i: i.arrival_s)
    now = 9.0
    slack = _order("sjf_slack")
    seq = slack.order(items, now)
    assert sorted(seq) == list(range(len(items))) and slack.first(items, now) == seq[0]

    def ends(seq: list[int]) -> dict[int, float]:
        t, out = now, {}
        for i in seq:
            t += items[i].prefill_s
            out[i] = t
        return out
    fifo, mine = ends(list(range(len(items)))), ends(seq)
    assert all(mine[i] <= items[i].deadline_s for i in fifo if fifo[i] <= items[i].deadline_s)
    new = _item("new", now, rng.choice((0.2, 1.0, 4.0)))
    with_new = slack.order([*items, new], now)
    pos = with_new.index(len(items))
    assert slack.ahead_s(items, new, now) == pytest.approx(
        sum(items[i].prefill_s for i in with_new[:pos]))


def _queued_view(waiting: tuple[QueuedPrefill, ...], started_s: float = 2.0) -> ClusterView:
    """One prefill instance at 100 s: ``started_s`` of started work, then ``waiting``."""
    total = started_s + sum(w.prefill_s for w in waiting)
    p = replace(prefill("p0", queue_s=total, queued=len(waiting) + 1), waiting=waiting)
    return view((p,), now_s=100.0)


@pytest.mark.parametrize("name, queue_s", [
    ("fifo", 2.0 + 4.0 + 4.0),     # behind everything
    ("sjf_aging", 2.0),            # 1 s (+10 s of age) beats 4 s (+9.9 s): only the started work
    ("edf", 2.0 + 4.0 + 4.0),      # everyone can still make the 30 s SLO: arrival order
    ("sjf_slack", 2.0),            # shortest first: "a" and "b" still end by their 129 s
])
def test_the_queue_estimate_is_the_work_the_order_serves_first(name: str,
                                                               queue_s: float) -> None:
    waiting = (_item("a", 99.0, 4.0, slo=30.0), _item("b", 99.0, 4.0, slo=30.0))
    pol = Policy(config(prefill_queue=name), PREDICTORS)
    route = pol.decide(request(1000), _queued_view(waiting))
    assert isinstance(route, Route)
    assert route.est_queue_s == pytest.approx(queue_s)
    assert route.est_prefill_s == pytest.approx(1.0)  # 1 ms per token
    assert route.est_ttft_s == pytest.approx(queue_s + 1.0)


def test_edf_estimates_a_late_request_behind_those_that_can_still_make_it() -> None:
    # "a" (due at 101 s) cannot finish its 4 s by then: the new request goes before it
    waiting = (_item("a", 71.0, 4.0, slo=30.0), _item("b", 99.0, 4.0, slo=30.0))
    pol = Policy(config(prefill_queue="edf"), PREDICTORS)
    route = pol.decide(request(1000), _queued_view(waiting))
    assert isinstance(route, Route) and route.est_queue_s == pytest.approx(2.0 + 4.0)


def test_queued_is_what_both_adapters_put_in_the_queue() -> None:
    pol = Policy(config(prefill_queue="sjf_aging", ttft_slo_s=10.0), PREDICTORS)
    req = request(1000)
    route = pol.decide(req, view((prefill("p0"),)))
    assert isinstance(route, Route)
    assert pol.queued(req, route) == QueuedPrefill("r1", 0.0, 1.0, 10.0)


def test_bad_names_and_values_are_refused_precisely() -> None:
    with pytest.raises(ConfigError, match="prefill_queue 'lifo' unknown; use one of "
                                          "edf, fifo, sjf_aging, sjf_slack"):
        PolicyConfig(prefill_queue="lifo")
    with pytest.raises(ConfigError, match="prefill_queue_aging must be a positive number"):
        PolicyConfig(prefill_queue_aging=0.0)
    bad = (QueuedPrefill("x", 0.0, -1.0, 10.0),)
    with pytest.raises(InputError, match="waiting requests need finite times and prefill_s"):
        Policy(config(prefill_queue="sjf_aging"), PREDICTORS).decide(request(1000),
                                                                     _queued_view(bad))


def test_sjf_slack_bounds_a_long_queues_wait_by_serving_the_new_request_last() -> None:
    """Past `EXACT_AHEAD_MAX` queued, the estimate is the bound of all their work (cheap);
    at or below it, the replay (a short new request goes ahead of long ones)."""
    from yuebing.conductor.policy.queue import EXACT_AHEAD_MAX, ShortestFirstInSlack
    order = ShortestFirstInSlack(aging=0.1, ttft_slo_s=1000.0)

    def item(k: int, prefill_s: float) -> QueuedPrefill:
        return QueuedPrefill(f"r{k}", k * 1e-3, prefill_s, 1000.0 + k * 1e-3)
    short = item(EXACT_AHEAD_MAX + 1, 0.01)
    few = [item(k, 1.0) for k in range(EXACT_AHEAD_MAX)]
    many = [item(k, 1.0) for k in range(EXACT_AHEAD_MAX + 1)]
    assert order.ahead_s(few, short, 0.0) == 0.0
    assert order.ahead_s(many, short, 0.0) == pytest.approx(EXACT_AHEAD_MAX + 1.0)
