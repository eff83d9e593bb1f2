"""Batch invariance in bf16: a request's tokens do not depend on what else the engine runs.

The probe of issue 15: 16 prompts run one at a time, then together, with preemption, with
small prefill chunks (mixed with decodes), and again over a warm prefix cache; greedy and
seeded sampling must give bit-identical tokens in every case. The native kernels (paged) and
the torch fallback (loop) are both checked.
"""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.core.errors import ConfigError
from yuebing.engine.config import EngineConfig
from yuebing.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("native_kernels")

GREEDY = SamplingParams(max_tokens=16, temperature=0)
SEEDED = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=7)
PROMPTS = prompts(16, seed=11, lo=5, hi=60)


def _engine(weights, kernels: str = "native", **kw: object):
    opts: dict[str, object] = dict(dtype="bfloat16", attention="auto", batch_invariant=True,
                                   kernels=kernels, num_blocks=256, max_batch_tokens=512)
    opts.update(kw)
    return make_engine(weights, **opts)


def _alone(weights, params: SamplingParams, kernels: str = "native") -> list[list[int]]:
    engine = _engine(weights, kernels, prefix_caching=False)
    return [engine.generate([p], params)[0].output_token_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(tiny_weights) -> dict[str, list[list[int]]]:
    return {"greedy": _alone(tiny_weights, GREEDY), "seeded": _alone(tiny_weights, SEEDED)}


SCENARIOS = {
    "together": dict(prefix_caching=False),
    "preempt": dict(num_blocks=40, block_size=4),
    "chunks": dict(max_batch_tokens=16, prefix_caching=False),
    "chunks_unmixed": dict(max_batch_tokens=16, mixed_batches=False, prefix_caching=False),
}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_batched_equals_alone(tiny_weights, alone, kind, scenario):
    params = GREEDY if kind == "greedy" else SEEDED
    engine = _engine(tiny_weights, **SCENARIOS[scenario])
    out = [o.output_token_ids for o in engine.generate(PROMPTS, params)]
    assert out == alone[kind]
    if scenario == "preempt":
        assert engine.stats()["preemptions"] > 0


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_prefix_hits_equal_alone(tiny_weights, alone, kind):
    params = GREEDY if kind == "greedy" else SEEDED
    engine = _engine(tiny_weights, max_batch_tokens=24)
    assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == alone[kind]
    hits = engine.stats()["prefix_hit_blocks"]
    assert [o.output_token_ids for o in engine.generate(PROMPTS, params)] == alone[kind]
    assert engine.stats()["prefix_hit_blocks"] > hits


def test_torch_fallback_is_invariant_and_matches(tiny_weights, alone):
    engine = _engine(tiny_weights, "torch", max_batch_tokens=16, num_blocks=60, block_size=4)
    assert engine.attention == "invariant:loop"
    out = [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert out == _alone(tiny_weights, GREEDY, "torch")


def test_seeded_request_beside_others_equals_it_alone(tiny_weights):
    """A seeded request keeps its own generator: unseeded neighbours do not shift its draws."""
    target = SamplingParams(max_tokens=16, temperature=1.0, seed=123)
    solo = _engine(tiny_weights).generate([PROMPTS[0]], target)[0].output_token_ids
    engine = _engine(tiny_weights)
    rid = engine.add_request(PROMPTS[0], target)
    for p in PROMPTS[1:6]:
        engine.add_request(p, SamplingParams(max_tokens=20, temperature=1.0))
    got: list[int] = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert got == solo


def test_invariant_attention_matches_reference_math(tiny_weights):
    """The invariant path computes the same function (bf16-close to the measured paths)."""
    ref = make_engine(tiny_weights, dtype="float32", batch_invariant=False)
    inv = make_engine(tiny_weights, dtype="float32", batch_invariant=True, attention="auto")
    rows = []
    for engine in (ref, inv):
        got: list[torch.Tensor] = []
        engine.logits_hook = lambda _ids, logits, got=got: got.append(logits.clone())
        engine.generate(PROMPTS[:4], SamplingParams(max_tokens=4, temperature=0))
        rows.append(torch.cat(got))
    torch.testing.assert_close(rows[0], rows[1], atol=1e-4, rtol=1e-4)


def test_explicit_attention_conflicts_with_batch_invariant():
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineConfig(attention="grouped", batch_invariant=True)
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineConfig(prefill_attention="flash", batch_invariant=True)
    assert EngineConfig(attention="grouped").attention == "grouped"  # invariance is opt-in
    assert not EngineConfig().batch_invariant
