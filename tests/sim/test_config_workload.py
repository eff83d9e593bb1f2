"""Boundaries: simulation configs and workloads refuse bad input with a precise message."""

from __future__ import annotations

import pytest

from yuebing.core.errors import ConfigError, InputError
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig, sim_policy
from yuebing.sim.workload import SimRequest, from_trace_requests
from yuebing.trace.model import Request


@pytest.mark.parametrize(("kw", "message"), [
    ({"prefill_nodes": 0}, "prefill_nodes must be >= 1"),
    ({"speed": 0.0}, "speed must be > 0"),
    ({"speed": float("inf")}, "speed must be > 0 and finite, got inf"),
    ({"dram_kv_tokens": 100}, "dram_kv_tokens must hold at least one block"),
    ({"cost_model": "fitted"}, "needs --profile"),
    ({"limit": -1}, "limit must be >= 0"),
    ({"output_tokens": -1}, "output_tokens must be >= 0"),
    ({"decode_tail": 0.9}, "decode_tail must be a finite number >= 1"),
    ({"decode_tail": float("nan")}, "decode_tail must be a finite number >= 1"),
    ({"system": "vllm", "decode_tail": 2.0}, "decode_tail is modelled for system mooncake only"),
])
def test_bad_configs_say_what_to_change(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SimConfig(**kw)  # type: ignore[arg-type]


def test_unknown_system_and_policy_names_list_the_known_ones() -> None:
    reqs = [SimRequest(0, 0.0, 100, 2, (1,))]
    with pytest.raises(ConfigError, match="known: .*mooncake"):
        simulate(reqs, SimConfig(system="sglang"))
    with pytest.raises(ConfigError, match="prefill_selector 'fastest' unknown"):
        simulate(reqs, SimConfig(policy=sim_policy(prefill_selector="fastest")))
    with pytest.raises(ConfigError, match="kvcache_balancing_threshold must be ≥ 1"):
        SimConfig(policy=sim_policy(kvcache_balancing_threshold=0.5))


def test_workload_conversion_and_its_errors() -> None:
    reqs = [Request(1000, 600, 3, (7, 8)), Request(3000, 100, 1, (7,))]
    out = from_trace_requests(reqs, speed=2.0)
    assert out == [SimRequest(0, 0.0, 600, 3, (7, 8)), SimRequest(1, 1.0, 100, 1, (7,))]
    with pytest.raises(InputError, match="output_length must be > 0"):
        from_trace_requests([Request(0, 10, 0, (1,))])
    with pytest.raises(InputError, match="speed must be > 0"):
        from_trace_requests(reqs, speed=0)
    with pytest.raises(InputError, match=r"sampling every 1e-09 s over 5 s of arrivals would "
                       r"take more than 1,000,000 samples"):
        simulate([SimRequest(0, 0.0, 100, 2, (1,)), SimRequest(1, 5.0, 100, 2, (2,))],
                 SimConfig(sample_interval_s=1e-9))
    with pytest.raises(InputError, match="sorted by arrival"):
        simulate([SimRequest(0, 5.0, 100, 2, (1,)), SimRequest(1, 1.0, 100, 2, (2,))],
                 SimConfig())


def test_output_tokens_override_gives_every_request_that_many() -> None:
    reqs = [SimRequest(0, 0.0, 1000, 50, (1, 2)), SimRequest(1, 1.0, 800, 7, (1, 3))]
    res = simulate(reqs, SimConfig(prefill_nodes=1, decode_nodes=1, output_tokens=1))
    assert [r.output_tokens for r in res.records] == [1, 1]
    assert all(r.finish_s == r.first_token_s for r in res.records)
    assert [r.output_tokens for r in simulate(reqs, SimConfig()).records] == [50, 7]
