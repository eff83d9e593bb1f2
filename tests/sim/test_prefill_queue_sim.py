"""The prefill queue order in the simulator: the same order as the live Conductor's gate on the
same inputs, FIFO unchanged, nothing starves."""

from __future__ import annotations

import asyncio

import pytest
from sim_fakes import LinearCost

from yuebing.conductor.gate import PrefillGate
from yuebing.conductor.policy import QueuedPrefill
from yuebing.core.errors import ConfigError
from yuebing.sim.predict import policy_for
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest

# one long prompt occupies the node while four more arrive (1 ms per token: 4 s, 3 s, 0.5 s, …)
ARRIVALS = [(0.0, 4000), (0.5, 3000), (1.0, 500), (1.5, 1500), (2.0, 200)]


def _requests() -> list[SimRequest]:
    return [SimRequest(i, t, n, 2, tuple(range(100 * i, 100 * i + n // 512)))
            for i, (t, n) in enumerate(ARRIVALS)]


def _config(order: str) -> SimConfig:
    return SimConfig(prefill_nodes=1, decode_nodes=1,
                     policy=sim_policy(prefill_queue=order, ttft_slo_s=5.0))


def _sim_order(order: str) -> list[str]:
    res = simulate(_requests(), _config(order), cost=LinearCost())
    return [str(r.index) for r in sorted(res.records, key=lambda r: r.prefill_start_s)]


def _gate_order(order: str) -> list[str]:
    """The live gate, one request at a time, given the simulator's queue items and clock."""
    reqs, cfg = _requests(), _config(order)
    pol = policy_for(cfg, LinearCost(), reqs)
    now = [0.0]

    async def main() -> list[str]:
        gate = PrefillGate(1, pol.queue_order, clock=lambda: now[0])
        admitted: list[str] = []

        async def go(r: SimRequest) -> None:
            item = QueuedPrefill(str(r.index), r.arrival_s, pol.prefill_time(r.input_tokens, 0),
                                 r.arrival_s + cfg.policy.ttft_slo_s)
            await gate.acquire(str(r.index), r.input_tokens, item)
            admitted.append(str(r.index))
        tasks = []
        for r in reqs:
            now[0] = r.arrival_s
            tasks.append(asyncio.ensure_future(go(r)))
            await asyncio.sleep(0)
        start = 0.0
        while len(admitted) < len(reqs):  # each prefill ends after its own 1 ms per token
            rid = admitted[-1]
            now[0] = start = start + ARRIVALS[int(rid)][1] * 1e-3
            gate.release(rid)
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return admitted
    return asyncio.run(main())


@pytest.mark.parametrize("order, expected", [
    ("fifo", ["0", "1", "2", "3", "4"]),
    # at 4 s: keys 3 s + 0.05, 0.5 + 0.1, 1.5 + 0.15, 0.2 + 0.2 → 4, 2, 3, 1
    ("sjf_aging", ["0", "4", "2", "3", "1"]),
    # at 4 s "1" (due 5.5 s, 3 s of work) is late: it yields to the others, due 6-7 s
    ("edf", ["0", "2", "3", "4", "1"]),
    # at 4 s "1" is late whatever comes first; "4" fits in the slack of "2" and "3" (due 6, 6.5 s)
    ("sjf_slack", ["0", "4", "2", "3", "1"]),
])
def test_the_simulator_and_the_gate_serve_the_same_inputs_in_the_same_order(
        order: str, expected: list[str]) -> None:
    assert _sim_order(order) == expected
    assert _gate_order(order) == expected


def test_each_prefill_starts_when_the_one_before_it_ends() -> None:
    res = simulate(_requests(), _config("sjf_aging"), cost=LinearCost())
    r = res.records
    assert [x.prefill_start_s for x in (r[0], r[4], r[2], r[3], r[1])] == pytest.approx(
        [0.0, 4.0, 4.2, 4.7, 6.2])
    assert all(x.rejected is None and x.queue_s + x.prefill_s == pytest.approx(x.ttft_s)
               for x in r)


def test_a_long_prompt_is_served_within_its_ageing_window() -> None:
    """A 6 s prompt behind a stream of 1 s ones (1 s of work every 0.5 s: overload) starts
    once the requests that arrived within 6 s / aging after it are served."""
    shorts = [(0.5 * k, 1024) for k in range(200)]
    arrivals = sorted([*shorts, (0.2, 6144)])
    reqs = [SimRequest(i, t, n, 2, tuple(range(100 * i, 100 * i + n // 512)))
            for i, (t, n) in enumerate(arrivals)]
    cfg = SimConfig(prefill_nodes=1, decode_nodes=1, policy=sim_policy(
        prefill_queue="sjf_aging", prefill_queue_aging=0.5, ttft_slo_s=1000.0))
    long_one = next(r for r in simulate(reqs, cfg, cost=LinearCost()).records
                    if r.input_tokens == 6144)
    # overtaken by the ones arriving within 12 s: ≤ 25 of 1.024 s, plus the one running
    assert long_one.queue_s <= 26 * 1.024
    pure = SimConfig(prefill_nodes=1, decode_nodes=1, policy=sim_policy(
        prefill_queue="sjf_aging", prefill_queue_aging=1e-6, ttft_slo_s=1000.0))
    long_pure = next(r for r in simulate(reqs, pure, cost=LinearCost()).records
                     if r.input_tokens == 6144)
    assert long_pure.queue_s > 150.0  # after (nearly) all 200 short ones


def test_the_order_is_a_checked_flag_of_sim_run(conversation_trace, capsys) -> None:  # type: ignore[no-untyped-def]
    from yuebing.cli.main import main

    with pytest.raises(ConfigError, match="prefill_queue 'lifo' unknown; use one of edf, fifo, "
                                          "sjf_aging, sjf_slack"):
        sim_policy(prefill_queue="lifo")
    assert main(["sim", "run", str(conversation_trace), "--limit", "50", "--prefill-queue",
                 "lifo"]) == 2
    assert "prefill_queue 'lifo' unknown" in capsys.readouterr().err


def test_a_pipelined_prefill_holds_its_group_and_the_queue_goes_on_after_it() -> None:
    """20,000 new tokens over both nodes (2 pipeline stages, 3 chunks: 20 s / 2 · 4/3), then two
    short prompts queued on p0: the shorter one first, each once the group is free."""
    reqs = [SimRequest(0, 0.0, 20_000, 2, tuple(range(39))),
            SimRequest(1, 1.0, 1000, 2, (100,)), SimRequest(2, 2.0, 500, 2, ())]
    cfg = SimConfig(prefill_nodes=2, decode_nodes=1, policy=sim_policy(
        prefill_queue="sjf_aging", cpp_threshold_tokens=10_000, cpp_max_nodes=2))
    r0, r1, r2 = simulate(reqs, cfg, cost=LinearCost()).records
    group_s = 20.0 / 2 * (1 + 1 / 3)
    assert r0.ttft_s == pytest.approx(group_s) and r0.prefill_gpu_s == pytest.approx(2 * group_s)
    assert (r1.prefill_id, r2.prefill_id) == ("p0", "p0")
    assert r2.prefill_start_s == pytest.approx(group_s)
    assert r1.prefill_start_s == pytest.approx(group_s + 0.5)
