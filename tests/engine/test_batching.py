"""Greedy outputs do not depend on how requests are batched, chunked, cached or preempted."""

from __future__ import annotations

import pytest
from engine_factories import make_engine, prompts

from yuebing.core.errors import InputError
from yuebing.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def reference(tiny_weights) -> list[list[int]]:
    """Each prompt run alone, unchunked, no prefix cache."""
    engine = make_engine(tiny_weights, prefix_caching=False, max_batch_tokens=64)
    return [engine.generate([p], GREEDY)[0].output_token_ids for p in prompts(8)]


def _run(engine, ps=None) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(ps or prompts(8), GREEDY)]


def test_reference_is_not_degenerate(reference):
    assert all(len(r) == 12 for r in reference)
    assert all(len(set(r)) >= 6 for r in reference), reference  # context-dependent outputs


@pytest.mark.parametrize("max_num_seqs", [1, 3, 8])
def test_batch_size_does_not_change_outputs(tiny_weights, reference, max_num_seqs):
    engine = make_engine(tiny_weights, max_num_seqs=max_num_seqs, prefix_caching=False)
    assert _run(engine) == reference


@pytest.mark.parametrize("budget,mixed", [(8, True), (13, True), (5, False), (64, False)])
def test_chunked_prefill_does_not_change_outputs(tiny_weights, reference, budget, mixed):
    engine = make_engine(tiny_weights, max_batch_tokens=budget, max_num_seqs=4,
                         mixed_batches=mixed)
    assert _run(engine) == reference


def test_prefix_cache_hits_give_same_outputs(tiny_weights, reference):
    engine = make_engine(tiny_weights, block_size=4, num_blocks=256)
    assert _run(engine) == reference
    hits_before = engine.stats()["prefix_hit_blocks"]
    again = engine.generate(prompts(8), GREEDY)
    assert [o.output_token_ids for o in again] == reference
    expected = sum((len(p) - 1) // 4 for p in prompts(8))
    assert engine.stats()["prefix_hit_blocks"] - hits_before == expected
    assert [o.num_cached_tokens for o in again] == [(len(p) - 1) // 4 * 4 for p in prompts(8)]


def test_shared_prefix_is_reused_across_requests(tiny_weights):
    base = prompts(1, seed=5, lo=20, hi=21)[0]
    solo = make_engine(tiny_weights, prefix_caching=False)
    ref = [solo.generate([base + [i]], GREEDY)[0].output_token_ids for i in range(3)]
    engine = make_engine(tiny_weights, block_size=4)
    first = engine.generate([base + [0]], GREEDY)[0]
    rest = engine.generate([base + [1], base + [2]], GREEDY)
    assert [first.output_token_ids] + [o.output_token_ids for o in rest] == ref
    assert first.num_cached_tokens == 0
    assert [o.num_cached_tokens for o in rest] == [20, 20]


def test_preemption_when_kv_runs_out(tiny_weights, reference):
    # 8 sequences of up to 41 tokens need up to 11 blocks each; 24 blocks force preemption
    engine = make_engine(tiny_weights, num_blocks=24, block_size=4, max_num_seqs=8)
    assert _run(engine) == reference
    assert engine.stats()["preemptions"] > 0
    assert engine.allocator.num_free == 24


def test_abort_frees_blocks_and_others_continue(tiny_weights, reference):
    engine = make_engine(tiny_weights, prefix_caching=False)
    ids = [engine.add_request(p, GREEDY) for p in prompts(8)]
    for _ in range(3):
        engine.step()
    assert engine.abort(ids[2]) is True
    assert engine.abort(ids[2]) is False
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
    assert sorted(final) == sorted(ids[:2] + ids[3:])
    assert [final[r] for r in ids if r != ids[2]] == reference[:2] + reference[3:]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_max_tokens_zero_and_context_limit(tiny_weights):
    engine = make_engine(tiny_weights, max_model_len=20)
    zero = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=0))[0]
    assert (zero.output_token_ids, zero.finished, zero.finish_reason) == ([], True, "length")
    capped = engine.generate([list(range(15))], SamplingParams(max_tokens=50, temperature=0))[0]
    assert len(capped.output_token_ids) == 5 and capped.finish_reason == "length"


def test_sequence_never_outgrows_the_pool(tiny_weights):
    engine = make_engine(tiny_weights, num_blocks=6, block_size=4)  # 24 tokens of KV
    assert engine.max_model_len == 24
    out = engine.generate([list(range(10))], SamplingParams(max_tokens=100, temperature=0))[0]
    assert len(out.output_token_ids) == 14 and out.finish_reason == "length"
    with pytest.raises(InputError, match="context holds 24"):
        engine.add_request(list(range(30)))


def test_abort_of_waiting_and_unknown_requests(tiny_weights, reference):
    engine = make_engine(tiny_weights, max_num_seqs=1, prefix_caching=False)
    ids = [engine.add_request(p, GREEDY) for p in prompts(8)[:3]]
    engine.step()  # only the first request runs (max_num_seqs=1)
    assert engine.get_sequence(ids[1]).blocks == []
    assert engine.abort(ids[1]) is True and engine.get_sequence(ids[1]) is None
    assert engine.abort("no-such-request") is False
    final = {o.request_id: o.output_token_ids
             for _ in range(100) for o in engine.step() if o.finished}
    assert final == {ids[0]: reference[0], ids[2]: reference[2]}
    assert engine.abort(ids[0]) is False  # already finished
    assert engine.allocator.num_free == engine.allocator.num_blocks
