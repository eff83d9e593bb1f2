"""Colocated nodes: the interference factors, the stretch rule, and the simulator applying the
factor only while the host-mate is busy (hand-computed on the linear cost model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sim_fakes import LinearCost

from yuebing.core.errors import InputError
from yuebing.sim.colocation import (
    HostMate,
    Interference,
    SharedHost,
    load_interference,
    stretch,
)
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest


def test_stretch_slows_only_the_overlap() -> None:
    assert stretch(0.0, 1.0, 5.0, 9.0, 2.0) == 1.0  # neighbour starts after the work ends
    assert stretch(0.0, 1.0, 0.0, 10.0, 2.0) == 2.0  # busy throughout
    assert stretch(0.0, 1.0, 0.5, 10.0, 2.0) == 1.5  # alone 0.5 s, then 0.5 s of work at 1/2
    assert stretch(0.0, 1.0, 0.0, 0.5, 2.0) == 1.25  # 0.25 s of work in 0.5 s, 0.75 s alone
    assert stretch(3.0, 1.0, 0.0, 2.0, 2.0) == 1.0  # the neighbour stopped before the start
    assert stretch(0.0, 1.0, 0.0, 10.0, 1.0) == 1.0
    assert stretch(0.0, 0.0, 0.0, 10.0, 2.0) == 0.0


def test_host_mate_stretches_a_step_inside_a_prefill_only() -> None:
    mate = HostMate(decode_factor=2.0)
    mate.add_prefill(1.0, 2.0, now=0.0)
    assert mate.decode_step(0.5, 0.1) == 0.1
    assert mate.decode_step(1.2, 0.1) == pytest.approx(0.2)
    assert mate.decode_step(1.95, 0.1) == pytest.approx(0.05 + 0.075)
    assert mate.decode_step(2.0, 0.1) == 0.1
    mate.add_prefill(3.0, 4.0, now=2.5)  # the first interval is over by now: dropped
    assert list(mate.intervals) == [(3.0, 4.0)]


def _write(tmp_path: Path, doc: dict[str, object]) -> Path:
    p = tmp_path / "samples.json"
    p.write_text(json.dumps(doc))
    return p


def test_load_interference_reads_the_samples_files_factors(tmp_path: Path) -> None:
    doc = {"format": "yuebing-profile-samples", "version": 1, "prefill": [], "decode": [],
           "interference": {"decode_factor": 1.3, "prefill_factor": 1.1, "samples": [],
                            "neighbour": "x"}}
    assert load_interference(_write(tmp_path, doc)) == Interference(1.3, 1.1)


@pytest.mark.parametrize(("doc", "message"), [
    ({"format": "yuebing-profile-samples", "version": 1}, "has no interference factors"),
    ({"interference": {"decode_factor": 1.2}}, "missing required field `prefill_factor`"),
    ({"interference": {"decode_factor": -1, "prefill_factor": 1}}, "decode_factor must be"),
])
def test_load_interference_rejects_files_without_valid_factors(
        tmp_path: Path, doc: dict[str, object], message: str) -> None:
    with pytest.raises(InputError, match=message):
        load_interference(_write(tmp_path, doc))


def test_colocated_needs_mooncake() -> None:
    with pytest.raises(ValueError, match="mooncake only"):
        SimConfig(system="vllm", colocated=True, interference_profile="x")


def _run(tmp_path: Path, colocated: bool) -> list[tuple[float, float]]:
    """A: 1,000 tokens at 0 s (prefill 1 s), 5 output tokens (4 steps of 50 ms from its KV at
    1.001 s); B: 100 tokens at 1.05 s (prefill 0.1 s alone), while A decodes."""
    path = _write(tmp_path, {"interference": {"decode_factor": 2.0, "prefill_factor": 1.5}})
    reqs = [SimRequest(0, 0.0, 1000, 5, (1,)), SimRequest(1, 1.05, 100, 3, (2,))]
    cfg = SimConfig(prefill_nodes=1, decode_nodes=1, colocated=colocated,
                    interference_profile=str(path))
    res = simulate(reqs, cfg, cost=LinearCost())
    return [(r.first_token_s, r.finish_s) for r in res.records]


def test_colocated_steps_slow_down_only_while_the_host_mate_is_busy(tmp_path: Path) -> None:
    alone = _run(tmp_path, colocated=False)
    assert alone[0] == pytest.approx((1.0, 1.201))
    assert alone[1][0] == pytest.approx(1.15)
    (a_first, a_end), (b_first, _) = _run(tmp_path, colocated=True)
    # A's prefill ran with the decode node idle: unchanged
    assert a_first == pytest.approx(1.0)
    # B's prefill (0.1 s alone) starts at 1.05 while A decodes until 1.201: all of it slowed
    assert b_first == pytest.approx(1.05 + 0.15)
    # A's steps: 1.001-1.051 before B's prefill (alone); 1.051-1.151 inside it (x2);
    # 1.151-1.2255: 0.049 s inside (B ends at 1.2) at half speed, then 0.0255 s alone;
    # 1.2255-1.2755 alone
    assert a_end == pytest.approx(1.2755)


def test_a_shared_host_reserves_the_decodes_core_and_the_prefills_take_turns() -> None:
    """2 cores, 2 prefill nodes and 1 decode node, one thread each: the decode's core is
    reserved while it has work, so its step never waits, and the prefills take turns on the
    other core. Only decode nodes beyond the reservation (1P2D) wait for a chunk end."""
    host = SharedHost(cores=2, decode_factor=1.0, prefill_nodes=2, decode_nodes=1)
    assert (host.reserved, host.free) == (1, 1)
    host.add_prefill(0, 1.0, 3.0, now=0.0, chunks=4)  # chunks end at 1.5, 2, 2.5, 3
    host.add_prefill(1, 2.1, 4.1, now=0.0, chunks=2)  # chunks end at 3.1, 4.1
    assert host.decode_step(0.0, 0.5) == 0.5
    assert host.decode_step(1.2, 0.5) == 0.5  # one prefill: a core each
    assert host.decode_step(2.2, 0.1) == 0.1  # both prefills: they take turns on one core
    assert host.decode_step(3.05, 0.1) == pytest.approx(0.1)  # node 0 has ended
    assert host.busy_at(2.5) == 2 and host.busy_at(2.5, but=[0]) == 1 and host.busy_at(5.0) == 0
    assert host.prefill_factors(0, 1.0, 0.3, 0.05) == (1.0, 1.0)  # it and the decode: a core each
    # beside the other prefill and a decode with work: the two take turns on one core
    assert host.prefill_factors(1, 1.0, 0.2, 0.05) == (1.0, 2.0)
    assert host.prefill_factors(2, 1.0, 0.2, 0.05) == (1.5, 2.0)  # three: 2 cores, then one
    # a pipeline group of both prefill nodes: its two threads take turns beside the decode
    assert host.prefill_factors(0, 1.0, 0.2, 0.05, threads=2) == (1.0, 2.0)
    assert host.prefill_factors(1, 1.0, 0.2, 0.05, threads=2)[0] == 1.5
    # 1P2D: the decodes claim both cores, the reservation keeps one for the prefill; a decode
    # step beside it waits for a chunk end, and the prefill yields a 50 ms step per 0.2 s chunk
    crowded = SharedHost(cores=2, decode_factor=1.0, prefill_nodes=1, decode_nodes=2)
    assert (crowded.reserved, crowded.free) == (1, 1)
    crowded.add_prefill(0, 1.0, 3.0, now=0.0, chunks=4)
    assert crowded.decode_step(2.2, 0.1) == pytest.approx(0.3 + 0.1)  # waits for 2.5
    assert crowded.prefill_factors(0, 1.0, 0.2, 0.05) == (1.0, pytest.approx(1.25))
    roomy = SharedHost(cores=3, decode_factor=1.0, prefill_nodes=2, decode_nodes=1)
    assert roomy.prefill_factors(1, 1.0, 0.2, 0.05) == (1.0, 1.0)  # 2 cores left: both run
    host.add_prefill(0, 5.0, 6.0, now=3.5)  # node 0's first interval is over: dropped
    assert list(host.intervals[0]) == [(5.0, 6.0, 1)]
    measured = SharedHost(cores=2, decode_factor=1.2, prefill_nodes=1, decode_nodes=1)
    measured.add_prefill(0, 0.0, 1.0, now=0.0)
    assert measured.decode_step(0.5, 0.1) == pytest.approx(0.12)
    with pytest.raises(ValueError, match="cores"):
        SharedHost(cores=0, decode_factor=1.0, prefill_nodes=1, decode_nodes=1)


def test_host_cores_needs_colocated() -> None:
    with pytest.raises(ValueError, match="host_cores"):
        SimConfig(host_cores=2)


def test_two_prefills_beside_a_decoding_node_take_turns_on_one_core(tmp_path: Path) -> None:
    """2P1D on 2 cores, 1 ms per prefill token, 512-token chunks, 50 ms decode steps: A (100
    tokens at 0 s, 20 output tokens, 19 steps) decodes from 0.1001 s; B and C (1,024 tokens
    each at 0.2 s) prefill on the two prefill nodes. The decode's core is reserved while it
    has work, so B and C take turns on the other: B, scheduled first, keeps 1.024 s; C takes
    the sharing, half speed over the decode's estimated window (A to 1.0501, then B's KV at
    1.225024 and its 2 steps, to 1.325024): 1.024 + 1.125024 / 2 = 1.586512 s. A never waits
    for a chunk: it ends at 1.0501 s, as on paired hosts (host_cores 0)."""
    path = _write(tmp_path, {"interference": {"decode_factor": 1.0, "prefill_factor": 1.0}})
    reqs = [SimRequest(0, 0.0, 100, 20, (1,)), SimRequest(1, 0.2, 1024, 3, (2,)),
            SimRequest(2, 0.2, 1024, 3, (3,))]
    ends, firsts = {}, {}
    for cores in (0, 2):
        cfg = SimConfig(prefill_nodes=2, decode_nodes=1, colocated=True, host_cores=cores,
                        interference_profile=str(path))
        cost = LinearCost()
        cost.prefill_chunk_tokens = 512
        res = simulate(reqs, cfg, cost=cost)
        a, b, c = res.records
        assert b.prefill_id != c.prefill_id
        ends[cores], firsts[cores] = a.finish_s, (b.first_token_s, c.first_token_s)
    assert ends[0] == pytest.approx(1.0501)
    assert firsts[2] == pytest.approx((0.2 + 1.024, 0.2 + 1.586512))
    assert ends[2] == pytest.approx(1.0501)


def test_a_pipeline_group_of_prefill_nodes_shares_their_hosts(tmp_path: Path) -> None:
    """2P1D, the linear cost model, 512-token chunks: A (100 tokens at 0 s, 20 output tokens)
    decodes from 0.1001 s; B (2,048 tokens at 0.2 s, threshold 1,000) prefills on a pipeline
    group of both prefill nodes: 2.048 / 2 × (1 + 1/4) = 1.28 s alone, 5 steps of 0.256 s per
    node. On 2 cores A's core is reserved while it runs (to 1.0501): B's two threads take
    turns on the other, at half speed, 0.8501 + 1.28 − 0.8501 / 2 = 1.70505 s; A never waits.
    Paired hosts (factors 2 / 1.5), prefill node 0 beside decode 0: B takes 0.8501 + 1.28 −
    0.8501 / 1.5 = 1.5634 s; A's steps inside it take 0.1 s: 15 to 1.7001, one across its end
    to 1.7817, one more: 1.8317. (Before, both hosts left a group alone: 1.48 and 1.0501.)"""
    reqs = [SimRequest(0, 0.0, 100, 20, (1,)), SimRequest(1, 0.2, 2048, 1, (2,))]
    policy = sim_policy(cpp_threshold_tokens=1000, cpp_max_nodes=2)
    got = {}
    for cores, factors in ((2, (1.0, 1.0)), (0, (2.0, 1.5))):
        path = _write(tmp_path, {"interference": {"decode_factor": factors[0],
                                                  "prefill_factor": factors[1]}})
        cfg = SimConfig(prefill_nodes=2, decode_nodes=1, colocated=True, host_cores=cores,
                        interference_profile=str(path), policy=policy)
        cost = LinearCost()
        cost.prefill_chunk_tokens = 512
        a, b = simulate(reqs, cfg, cost=cost).records
        assert b.prefill_gpu_s == pytest.approx(2 * (b.first_token_s - 0.2))  # both nodes
        got[cores] = (b.first_token_s, a.finish_s)
    assert got[2] == pytest.approx((0.2 + 1.70505, 1.0501))
    assert got[0] == pytest.approx((0.2 + 1.5633667, 1.8317333))


def test_declared_pipeline_groups_are_refused_on_colocated_hosts() -> None:
    """Their stage nodes belong to no simulated host: refused, not silently left alone."""
    with pytest.raises(ValueError, match="cpp_groups"):
        SimConfig(colocated=True, cpp_groups=1, interference_profile="x")


def test_colocated_slow_steps_take_the_tail_the_decode_factor_leaves(tmp_path: Path) -> None:
    """``decode_tail`` is what a live Conductor learns, a tail its steps beside a prefill are
    part of: colocated, the slow steps take ``decode_tail / decode_factor`` (at least 1). One
    request at a time (512 tokens, 60 steps of 50 ms), never beside a prefill: with decode
    factor 2, a tail of 3 leaves slow steps of 1.5x, a tail of 2 none; apart, 3x."""
    path = _write(tmp_path, {"interference": {"decode_factor": 2.0, "prefill_factor": 1.0}})
    reqs = [SimRequest(i, i * 5.0, 512, 61, (i,)) for i in range(20)]

    def tbts(tail: float, colocated: bool) -> list[float]:
        cfg = SimConfig(prefill_nodes=1, decode_nodes=1, colocated=colocated,
                        interference_profile=str(path), decode_tail=tail,
                        policy=sim_policy(seed=1))
        return [r.tbt_s for r in simulate(reqs, cfg, cost=LinearCost()).records]

    even = 0.05 + 512e-6 / 6  # the KV hand-over in the first interval
    assert {round(t, 9) for t in tbts(2.0, True)} == {round(even, 9)}
    half = tbts(3.0, True)
    assert max(half) == pytest.approx(0.075, abs=1e-4) and all(t <= 0.075 + 1e-4 for t in half)
    assert max(tbts(3.0, False)) == pytest.approx(0.15, abs=1e-4)


def test_a_decode_node_without_a_host_mate_takes_the_whole_tail(tmp_path: Path) -> None:
    """Colocated without ``host_cores`` only decode node i < P has a host-mate to stretch its
    steps; the others' slow steps take the whole ``decode_tail`` (review: every colocated node
    divided it by the decode factor), and a factor below 1 never raises the tail."""
    from yuebing.sim.loop import EventLoop
    from yuebing.sim.mooncake import MooncakeSystem
    from yuebing.sim.system import SystemContext

    def tails(factor: float) -> list[float | None]:
        path = _write(tmp_path, {"interference": {"decode_factor": factor,
                                                  "prefill_factor": 1.0}})
        cfg = SimConfig(prefill_nodes=1, decode_nodes=2, colocated=True,
                        interference_profile=str(path), decode_tail=3.0,
                        policy=sim_policy(seed=1))
        system = MooncakeSystem(SystemContext(loop=EventLoop(seed=1), cost=LinearCost(),
                                              config=cfg))
        return [d.slow.tail if d.slow is not None else None for d in system.decodes]

    assert tails(2.0) == [1.5, 3.0]
    assert tails(0.5) == [3.0, 3.0]
