"""Decode instance: continuous batching bounded by KV capacity, exact token times, and the
macro-stepped plan agreeing with a naive one-event-per-iteration reference."""

from __future__ import annotations

import random

import pytest

from yuebing.sim.decode import SLOW_SHARE, DecodeInstance, DecodeJob, SlowSteps
from yuebing.sim.hardware import CostModel
from yuebing.sim.loop import EventLoop, Priority
from yuebing.sim.metrics import RequestRecord, learned_tail
from yuebing.trace.latency import nearest_rank


class StepCost(CostModel):
    """Decode iteration = 0.1 s + 1 ms per sequence + 1 µs per context token."""

    def __init__(self, capacity: int) -> None:
        self.kv_bytes_per_token = 1
        self.decode_kv_capacity_tokens = capacity
        self.link_Bps = 1e9
        self.link_latency_s = 0.0

    def prefill_time(self, new_tokens: int, cached_tokens: int) -> float:
        return 0.0

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        return 0.1 + 0.001 * batch_size + 1e-6 * context_tokens


def _job(i: int, t: float, n_in: int, n_out: int) -> DecodeJob:
    rec = RequestRecord(index=i, arrival_s=t, input_tokens=n_in, output_tokens=n_out)
    rec.first_token_s = rec.kv_ready_s = t
    return DecodeJob(rec, n_in, n_out)


def test_small_batch_exact_times() -> None:
    loop = EventLoop()
    inst = DecodeInstance("d0", loop, StepCost(capacity=1000))
    a, c, b = _job(0, 0.0, 100, 3), _job(1, 0.05, 10, 2), _job(2, 0.06, 850, 100)
    for job in (a, c, b):
        loop.at(job.record.arrival_s, Priority.COMPLETE, inst.enqueue, job)
    loop.run()
    s0 = 0.1 + 0.001 + 1e-6 * 101                  # A alone, context 100 + first token
    s1 = 0.1 + 0.002 + 1e-6 * (102 + 11)           # C joined at the first boundary
    assert a.record.decode_start_s == 0.0 and c.record.decode_start_s == pytest.approx(s0)
    assert a.record.finish_s == pytest.approx(s0 + s1)
    assert c.record.finish_s == pytest.approx(s0 + s1)
    assert a.record.tbt_s == pytest.approx(max(s0, s1))
    assert c.record.tbt_s == pytest.approx(s0 + s1 - 0.05)
    # B (950 KV tokens) could not fit beside A (103) and C (12): it joins when both leave
    assert b.record.decode_start_s == pytest.approx(s0 + s1)
    assert b.record.finish_s > b.record.decode_start_s + 99 * 0.1
    assert inst.batch_size == 0 and inst.kv_reserved == 0 and inst.kv_used == 0


def test_refuses_jobs_it_can_never_hold() -> None:
    inst = DecodeInstance("d0", EventLoop(), StepCost(capacity=100))
    with pytest.raises(ValueError, match="more than the instance holds"):
        inst.enqueue(_job(0, 0.0, 90, 20))
    with pytest.raises(ValueError, match="no token to decode"):
        inst.enqueue(_job(1, 0.0, 10, 1))
    assert not inst.waiting


def _reference(jobs: list[tuple[float, int, int]], capacity: int) -> list[list[float]]:
    """One loop iteration at a time: admit FIFO at boundaries, everyone gets a token."""
    cost = StepCost(capacity)
    t, i, pending = 0.0, 0, sorted(range(len(jobs)), key=lambda k: (jobs[k][0], k))
    waiting: list[int] = []
    batch: dict[int, int] = {}
    ctx, reserved = 0, 0
    times: list[list[float]] = [[jobs[k][0]] for k in range(len(jobs))]
    while i < len(pending) or waiting or batch:
        while i < len(pending) and jobs[pending[i]][0] <= t:
            waiting.append(pending[i])
            i += 1
        while waiting and reserved + jobs[waiting[0]][1] + jobs[waiting[0]][2] <= capacity:
            k = waiting.pop(0)
            batch[k] = jobs[k][2] - 1
            reserved += jobs[k][1] + jobs[k][2]
            ctx += jobs[k][1] + 1
        if not batch:
            t = jobs[pending[i]][0]
            continue
        t += cost.decode_step_time(len(batch), ctx)
        ctx += len(batch)
        for k in list(batch):
            times[k].append(t)
            batch[k] -= 1
            if batch[k] == 0:
                del batch[k]
                reserved -= jobs[k][1] + jobs[k][2]
                ctx -= jobs[k][1] + jobs[k][2]
    return times


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_macro_steps_match_one_event_per_iteration(seed: int) -> None:
    rng = random.Random(seed)
    jobs = [(round(rng.uniform(0, 30), 3), rng.randint(10, 400), rng.randint(2, 120))
            for _ in range(60)]
    capacity = 3000
    loop = EventLoop()
    inst = DecodeInstance("d0", loop, StepCost(capacity))
    made = [_job(k, t, n_in, n_out) for k, (t, n_in, n_out) in enumerate(jobs)]
    for job in made:
        loop.at(job.record.arrival_s, Priority.COMPLETE, inst.enqueue, job)
    loop.run()
    expected = _reference(jobs, capacity)
    for job, times in zip(made, expected, strict=True):
        assert job.record.finish_s == pytest.approx(times[-1], abs=1e-9)
        assert job.record.tbt_s == pytest.approx(
            _tbt(times), abs=1e-9), f"request {job.record.index}"


def _tbt(times: list[float]) -> float:
    gaps = sorted((b - a for a, b in zip(times, times[1:], strict=False)), reverse=True)
    k = -(-len(gaps) // 10)
    return sum(gaps[:k]) / k


class EvenCost(StepCost):
    """Every decode iteration takes 50 ms."""

    def decode_step_time(self, batch_size: int, context_tokens: int) -> float:
        return 0.05


def test_slow_steps_are_drawn_by_step_index_whatever_the_order_asked() -> None:
    """Step k is slow or not from the seed alone: asking far ahead first (a plan) and then
    again (a re-plan after a truncation) gives the same factors as asking in order."""
    in_order = SlowSteps(2.5, random.Random(7))
    ahead = SlowSteps(2.5, random.Random(7))
    ahead.factor(700)
    factors = [in_order.factor(k) for k in range(1000)]
    assert [ahead.factor(k) for k in range(1000)] == factors
    assert set(factors) == {1.0, 2.5}
    assert 0.07 < factors.count(2.5) / len(factors) < 0.13  # SLOW_SHARE = 0.1
    assert [SlowSteps(2.5, random.Random(8)).factor(k) for k in range(1000)] != factors
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="decode tail must be a finite number >= 1"):
            SlowSteps(bad, random.Random(0))


def test_slow_steps_lengthen_the_planned_steps_through_re_plans() -> None:
    """Arrivals mid-plan truncate and re-plan it; each iteration k still takes its cost-model
    time (50 ms) times the factor of step k, no other."""
    loop = EventLoop()
    inst = DecodeInstance("d0", loop, EvenCost(capacity=100_000),
                          slow=SlowSteps(3.0, random.Random(1)))
    jobs = [_job(i, 0.37 * i, 50, 40) for i in range(30)]
    for job in jobs:
        loop.at(job.record.arrival_s, Priority.COMPLETE, inst.enqueue, job)
    loop.run()
    ref = SlowSteps(3.0, random.Random(1))
    ends = inst.step_ends
    starts = [jobs[0].record.arrival_s, *ends[:-1]]
    idle = {j.record.decode_start_s for j in jobs}  # a step after an idle spell starts there
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        if a < b - 0.05 * ref.factor(k) - 1e-9:
            assert b - 0.05 * ref.factor(k) == pytest.approx(max(x for x in idle if x <= b))
        else:
            assert b - a == pytest.approx(0.05 * ref.factor(k))
    assert 3.0 in {ref.factor(k) for k in range(len(ends))}


def test_the_tails_quantile_over_requests_is_the_decode_tail() -> None:
    """One request at a time on a node of even 50 ms steps, a tenth of them 2x slower: the 0.9
    quantile over requests of paper TBT per step (what the live Conductor learns as its TBT
    tail) is 2; some requests have fewer slow steps than their slowest tenth, and the mean step
    is 1 + 0.1 of the extra; without `SlowSteps` every ratio is 1."""
    def ratios(slow: SlowSteps | None) -> tuple[list[float], float]:
        loop = EventLoop()
        inst = DecodeInstance("d0", loop, EvenCost(capacity=100_000), slow=slow)
        jobs = [_job(i, 10.0 * i, 50, 101) for i in range(300)]  # 100 intervals each
        for job in jobs:
            loop.at(job.record.arrival_s, Priority.COMPLETE, inst.enqueue, job)
        loop.run()
        means = [j.record.tbt_mean_s for j in jobs]
        assert all(j.record.step_mean_s == pytest.approx(0.05) for j in jobs)  # as predicted
        for j in jobs:
            j.record.prefill_busy = True
        assert learned_tail([j.record for j in jobs]) == pytest.approx(
            nearest_rank([j.record.tbt_s / 0.05 for j in jobs[-32:]], 0.9))
        return [j.record.tbt_s / 0.05 for j in jobs], sum(means) / len(means) / 0.05

    got, mean = ratios(SlowSteps(2.0, random.Random(3)))
    assert nearest_rank(got, 0.9) == pytest.approx(2.0)
    assert nearest_rank(got, 0.1) < 1.9
    assert mean == pytest.approx(1 + SLOW_SHARE * (2.0 - 1), rel=0.03)
    even, mean = ratios(None)
    assert max(even) == pytest.approx(1.0) and mean == pytest.approx(1.0)


def test_step_mean_is_the_time_mean_predicted_step_from_the_second_token() -> None:
    """A request's `step_mean_s` weighs each of its iterations after its first by its
    duration (the Conductor's ledger), at the cost model's step: slow steps do not count."""
    loop = EventLoop()
    inst = DecodeInstance("d0", loop, StepCost(capacity=10_000),
                          slow=SlowSteps(3.0, random.Random(5)))
    a, b = _job(0, 0.0, 100, 12), _job(1, 0.35, 100, 4)
    for job in (a, b):
        loop.at(job.record.arrival_s, Priority.COMPLETE, inst.enqueue, job)
    loop.run()
    ends, ref = inst.step_ends, SlowSteps(3.0, random.Random(5))
    durations = [ends[k] - ends[k - 1] for k in range(1, len(ends))]
    steps = [d / ref.factor(k) for k, d in enumerate(durations, start=1)]
    want = sum(p * d for p, d in zip(steps, durations, strict=True)) / sum(durations)
    assert a.record.step_mean_s == pytest.approx(want)  # its steps 1..10 (a joined at 0)
    assert b.record.step_mean_s > 0.1 and b.record.step_mean_s != a.record.step_mean_s
