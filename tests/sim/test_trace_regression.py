"""Regression tests on slices of the released conversation trace (fixture
``conversation_trace``): exact counts and pinned aggregates, so a change in routing, caching
or timing shows up as a diff here."""

from __future__ import annotations

from pathlib import Path

import pytest

from yuebing.sim.paper import fig5
from yuebing.sim.runner import simulate
from yuebing.sim.system import SimConfig
from yuebing.sim.workload import load_requests


@pytest.fixture(scope="module")
def first_1500(conversation_trace: Path) -> list:
    return load_requests(conversation_trace, limit=1500)


def test_slice_loads_in_time_order(first_1500: list) -> None:
    assert len(first_1500) == 1500
    assert first_1500[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(first_1500, first_1500[1:],
                                                          strict=False))
    assert first_1500[0].input_tokens == 6758 and first_1500[0].block_keys[:3] == (0, 1, 2)


def test_mooncake_slice_is_deterministic_and_complete(first_1500: list) -> None:
    a = simulate(first_1500, SimConfig())
    b = simulate(first_1500, SimConfig())
    assert a.summary == b.summary
    assert a.summary["completed"] == 1500 and a.summary["rejected"] == 0
    assert [r.first_token_s for r in a.records] == [r.first_token_s for r in b.records]
    # every served token of KV is accounted for: hits never exceed the prompt
    assert all(0 <= r.hit_tokens < r.input_tokens for r in a.records)
    assert sum(r.hit_tokens for r in a.records) == PINNED["hit_tokens"]
    assert sum(r.fetched_tokens for r in a.records) == PINNED["fetched_tokens"]
    assert a.extra["decode_iterations"] == PINNED["decode_iterations"]
    assert a.summary["ttft_s"]["mean"] == pytest.approx(PINNED["mean_ttft_s"], rel=1e-9)
    # a few requests miss 100 ms: short outputs whose first interval holds a long KV transfer
    assert a.summary["effective_capacity"]["100"] == pytest.approx(PINNED["capacity_100"])
    for r in a.records:
        assert r.queue_s + r.prefill_s == pytest.approx(r.ttft_s)
        assert r.first_token_s <= r.kv_ready_s <= r.decode_start_s <= r.finish_s
        assert r.fetched_tokens <= r.hit_tokens


def test_policy_ordering_on_a_slice(conversation_trace: Path) -> None:
    ttft = fig5.compute(conversation_trace, fast=True)
    assert ttft["random"] > ttft["load_balance"] > ttft["local_cache_aware"] \
        > ttft["global_cache_aware"]


PINNED = {"hit_tokens": 5_588_708, "fetched_tokens": 2_780_943, "decode_iterations": 138_498,
          "mean_ttft_s": 1.874199475142562, "capacity_100": 1471 / 1500}
"""First 1500 requests, default `SimConfig` (8P+8D, global cache-aware, roofline calibrated to
Figure 14)."""
