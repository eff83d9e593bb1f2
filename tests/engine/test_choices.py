"""n > 1 in the engine: one prefill, then n choices forked on the prompt's KV blocks (shared
full blocks, the last one copied), each sampling with its own seed stream; and the handoff form
(`adopt_choices`) a decode instance uses."""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.engine.kv_transfer import adopt_choices, reserve_blocks
from yuebing.engine.sampling import SamplingParams


def _choices(engine, rid):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                outs.setdefault(o.index, []).append(o)
    return outs


@pytest.mark.parametrize("prompt_len", [21, 32])  # a partly filled last block, and none
def test_n_choices_share_one_prefill_and_match_single_requests(tiny_weights, prompt_len):
    p = prompts(1, seed=4, lo=prompt_len, hi=prompt_len + 1)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=4, ignore_eos=True,
                            logprobs=2)
    engine = make_engine(tiny_weights)
    computed = []
    engine.add_layer_hook(lambda layer, meta: layer == 0 and computed.append(
        sum(n for _, n in engine.current_plan.prefills)))
    free = engine.allocator.num_free
    rid = engine.add_request(p, params)
    outs = _choices(engine, rid)
    assert sum(computed) == len(p)  # the prompt was computed once
    assert engine.allocator.num_free == free  # every block came back
    assert sorted(outs) == [0, 1, 2, 3]
    assert [o.done for o in outs[0]].count(True) + sum(
        [o.done for o in outs[j]].count(True) for j in (1, 2, 3)) == 1
    for j in range(4):
        got = outs[j][-1].output_token_ids
        assert len(got) == 6 and all(o.logprobs[0] is not None for o in outs[j])
        alone = make_engine(tiny_weights).generate(
            [p], SamplingParams(max_tokens=6, temperature=1.0, seed=11 + j, ignore_eos=True))[0]
        assert got == alone.output_token_ids, j
    assert len({tuple(outs[j][-1].output_token_ids) for j in range(4)}) > 1


def test_abort_ends_every_choice(tiny_weights):
    engine = make_engine(tiny_weights)
    free = engine.allocator.num_free
    rid = engine.add_request(prompts(1, seed=5, lo=20, hi=21)[0],
                             SamplingParams(max_tokens=50, temperature=1.0, n=3))
    engine.step()
    engine.step()
    assert len(engine._seqs) == 3
    assert engine.abort(rid) and not engine._seqs and not engine.has_unfinished()
    assert engine.allocator.num_free == free


def test_adopt_choices_forks_the_handed_off_kv(tiny_weights):
    p = prompts(1, seed=6, lo=19, hi=20)[0]
    pre = make_engine(tiny_weights)
    rid = pre.add_request(p, SamplingParams(max_tokens=1, temperature=1.0, seed=3, n=3),
                          hold_kv=True)
    outs = [o for o in _choices(pre, rid).values() for o in o]
    assert sorted(o.index for o in outs) == [0, 1, 2] and outs[-1].done
    firsts = [o.new_token_ids[0] for o in sorted(outs, key=lambda o: o.index)]
    held = pre.held_sequence(rid)
    assert held is not None and len(held.blocks) == 5 and all(pre.held_sequence(f"{rid}#{j}") is None for j in (1, 2))
    dec = make_engine(tiny_weights)
    blocks = reserve_blocks(dec, len(p))
    dec.pool.import_blocks(blocks, pre.pool.export_blocks(held.blocks))
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=3, ignore_eos=True)
    first = adopt_choices(dec, "r", p, blocks, firsts, params)
    assert [o.index for o in first] == [0, 1, 2]
    outs = _choices(dec, "r")
    for j in range(3):
        ids = outs[j][-1].output_token_ids
        assert ids[0] == firsts[j] and len(ids) == 5
    # the coupled engine's choices continue from the same KV and generators
    coupled = make_engine(tiny_weights)
    crid = coupled.add_request(p, params)
    ref = _choices(coupled, crid)
    assert [ref[j][-1].output_token_ids[0] for j in range(3)] == firsts
    assert torch.equal(dec.pool.data[:, :, blocks[0]], pre.pool.data[:, :, held.blocks[0]])
    pre.release(rid)
