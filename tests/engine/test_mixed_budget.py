"""The mixed step's token budget (`scheduler.MixedBudget`, ``EngineConfig.mixed_step_s``): a prefill
chunk beside running decodes is sized from the measured cost per token so the step stays within
its target; alone a chunk takes the whole ``max_batch_tokens``; a prompt always advances."""

from __future__ import annotations

import pytest
from engine_factories import make_engine, prompts

from yuebing.core.errors import ConfigError
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.scheduler import MixedBudget


def test_budget_follows_the_measured_cost_per_token() -> None:
    b = MixedBudget(0.09, max_tokens=512, floor=64)
    assert b.tokens() == 512  # nothing timed yet
    b.observe(16, 1, 0.5)  # a step with too few prefill tokens says nothing
    b.observe(512, 0, 0.5)  # nor one without decodes (no fixed part shared with them)
    assert b.per_token_s is None and b.tokens() == 512
    b.observe(512, 1, 0.171)  # 0.333 ms a token: 0.09 s holds 270
    assert 269 <= b.tokens() <= 270
    for _ in range(40):  # a slower host phase: the average follows it
        b.observe(256, 1, 0.257)
    assert 89 <= b.tokens() <= 90
    for _ in range(40):  # far slower: never below the floor
        b.observe(256, 1, 2.57)
    assert b.tokens() == 64
    for _ in range(40):  # far faster: never above max_tokens
        b.observe(256, 1, 0.0001)
    assert b.tokens() == 512


def test_budget_off_takes_the_whole_step() -> None:
    b = MixedBudget(0.0, max_tokens=512, floor=64)
    b.observe(512, 1, 10.0)
    assert b.per_token_s is None and b.tokens() == 512
    small = MixedBudget(0.09, max_tokens=32, floor=64)
    assert small.floor == 32
    tiny_blocks = MixedBudget(0.09, max_tokens=512, floor=16)  # block size 4: a floor of 16
    tiny_blocks.observe(16, 3, 0.19)  # a floor-sized chunk is timed, so the budget can recover
    assert tiny_blocks.per_token_s == pytest.approx(0.01)


def _decoding_engine(tiny_weights, decodes: int = 1, **kw):
    """An engine with ``decodes`` requests decoding and a long prompt waiting."""
    engine = make_engine(tiny_weights, max_batch_tokens=256, num_blocks=256, **kw)
    for p in prompts(decodes, seed=1):
        engine.add_request(p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    while len(engine.scheduler.running) < decodes or any(
            s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    engine.add_request(list(range(1, 250)), SamplingParams(max_tokens=2, temperature=0))
    return engine


def test_a_chunk_beside_decodes_is_cut_to_the_budget(tiny_weights) -> None:
    engine = _decoding_engine(tiny_weights, mixed_step_s=0.09)
    engine.scheduler.budget.per_token_s = 0.09 / 100  # 100 tokens fit the target
    engine.step()
    plan = engine.last_plan
    assert plan is not None and len(plan.decodes) == 1
    assert [n for _, n in plan.prefills] == [99]  # the budget less the decode row
    # the engine timed that step: its cost per token replaced the one set above
    assert engine.scheduler.budget.per_token_s != pytest.approx(0.09 / 100, rel=1e-9)


def test_a_chunk_alone_or_with_the_budget_off_takes_the_whole_step(tiny_weights) -> None:
    off = _decoding_engine(tiny_weights, mixed_step_s=0.0)
    off.scheduler.budget.per_token_s = 0.09 / 100  # ignored: off
    off.step()
    assert off.last_plan is not None and [n for _, n in off.last_plan.prefills] == [249]
    alone = make_engine(tiny_weights, max_batch_tokens=256, num_blocks=256, mixed_step_s=0.09)
    alone.scheduler.budget.per_token_s = 0.09 / 100
    alone.add_request(list(range(1, 250)), SamplingParams(max_tokens=2, temperature=0))
    alone.step()
    assert alone.last_plan is not None and [n for _, n in alone.last_plan.prefills] == [249]


def test_decodes_that_fill_the_budget_still_leave_a_chunk_its_floor(tiny_weights) -> None:
    engine = _decoding_engine(tiny_weights, decodes=3, mixed_step_s=0.09)
    engine.scheduler.budget.per_token_s = 1.0  # nothing fits the target
    engine.step()
    plan = engine.last_plan
    assert plan is not None and len(plan.decodes) == 3
    assert [n for _, n in plan.prefills] == [engine.scheduler.budget.floor]


def test_a_negative_target_is_refused() -> None:
    with pytest.raises(ConfigError, match="mixed_step_s must be >= 0"):
        EngineConfig(mixed_step_s=-0.1)
