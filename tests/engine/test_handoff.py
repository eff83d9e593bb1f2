"""Engine pieces of the prefill → decode hand-off: held KV after a prefill-only request,
reserved blocks filled from outside, and adoption of a request with its first token."""

from __future__ import annotations

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.core.errors import EngineError, InputError
from yuebing.engine.kv_transfer import adopt_request, reserve_blocks
from yuebing.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_prefill_only_request_keeps_its_kv_until_released(tiny_weights):
    e = make_engine(tiny_weights)
    p = prompts(1, seed=4, lo=22, hi=23)[0]
    rid = e.add_request(p, SamplingParams(max_tokens=1, temperature=0), hold_kv=True)
    outs = [o for _ in range(4) for o in e.step()]
    assert [o.finished for o in outs] == [True]
    seq = e.held_sequence(rid)
    assert seq is not None and seq.num_computed == len(p) and len(seq.blocks) == 6
    assert e.allocator.num_free == e.allocator.num_blocks - 6
    assert not e.has_unfinished()
    with pytest.raises(InputError, match="already in use"):
        e.add_request(p, request_id=rid)
    assert e.release(rid) and not e.release(rid)
    assert e.allocator.num_free == e.allocator.num_blocks


def test_abort_frees_held_kv(tiny_weights):
    e = make_engine(tiny_weights)
    rid = e.add_request(prompts(1, seed=5)[0], SamplingParams(max_tokens=1), hold_kv=True)
    while e.has_unfinished():
        e.step()
    assert e.abort(rid) and e.allocator.num_free == e.allocator.num_blocks


def _prefill_into(pre, dec, p: list[int]) -> tuple[str, list[int], int]:
    """Prefill ``p`` on ``pre`` holding its KV, copy that KV layer by layer into blocks reserved
    on ``dec`` (what the streamer's writes do); the prefill's request id, the blocks, the first
    token."""
    rid = pre.add_request(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
                          hold_kv=True)
    first = [o for o in pre.step()][0].new_token_ids[0]
    held = pre.held_sequence(rid)
    assert held is not None
    blocks = reserve_blocks(dec, len(p))
    for layer in range(dec.pool.num_layers):
        dec.pool.import_layer(layer, blocks, pre.pool.export_layer(layer, held.blocks))
    return rid, blocks, first


def test_an_adopted_request_joins_the_running_decodes_as_a_decode_row(tiny_weights):
    """Its KV is all there and one token is left: its first step is one more decode row (the
    step stays decode-only: test_fused_decode.py shows the fused layer runs it), not a 1-token
    prefill chunk; tokens as if local."""
    p, q = prompts(2, seed=8, lo=21, hi=30)
    ref = make_engine(tiny_weights).generate([p], GREEDY)[0].output_token_ids
    pre, dec = make_engine(tiny_weights), make_engine(tiny_weights)
    qid = dec.add_request(q, GREEDY)
    while not dec.get_sequence(qid).output_ids:  # q decodes when r arrives
        dec.step()
    _, blocks, first = _prefill_into(pre, dec, p)
    adopt_request(dec, "r", p, blocks, first, GREEDY)
    dec.step()
    plan = dec.last_plan
    assert plan is not None and not plan.prefills
    assert [s.request_id for s in plan.joined] == ["r"] and len(plan.decodes) == 2
    final = {o.request_id: o for _ in range(40) for o in dec.step() if o.finished}
    assert final["r"].output_token_ids == ref


def test_adopted_request_continues_exactly_like_a_local_one(tiny_weights):
    p = prompts(1, seed=6, lo=21, hi=22)[0]
    ref = make_engine(tiny_weights).generate([p], GREEDY)[0].output_token_ids
    pre, dec = make_engine(tiny_weights), make_engine(tiny_weights)
    rid, blocks, first = _prefill_into(pre, dec, p)
    assert len(blocks) == 6 and dec.allocator.num_free == dec.allocator.num_blocks - 6
    pre.release(rid)
    out = adopt_request(dec, "r", p, blocks, first, GREEDY)
    assert out.new_token_ids == [first] and not out.finished
    final = [o for _ in range(40) for o in dec.step() if o.finished]
    assert final[0].output_token_ids == ref
    assert dec.allocator.num_free == dec.allocator.num_blocks


def test_reserve_refuses_when_the_pool_is_short(tiny_weights):
    dec = make_engine(tiny_weights, num_blocks=8)
    busy = dec.allocator.allocate_many(3)
    with pytest.raises(EngineError, match="KV cache has 5 free blocks, the request needs 6"):
        reserve_blocks(dec, 22)
    assert dec.allocator.num_free == 5
    dec.allocator.release_all(busy)


def test_adopt_checks_blocks_and_token(tiny_weights):
    dec = make_engine(tiny_weights)
    p = prompts(1, seed=6, lo=21, hi=22)[0]
    blocks = reserve_blocks(dec, len(p))
    with pytest.raises(InputError, match="5 blocks cannot hold a prompt of 21 tokens"):
        adopt_request(dec, "r", p, blocks[:5], 1, GREEDY)
    with pytest.raises(InputError, match="not in the vocabulary"):
        adopt_request(dec, "r", p, blocks, 10**6, GREEDY)
    assert dec.get_sequence("r") is None and torch.is_tensor(dec.pool.data)


def test_adopt_with_a_stopping_first_token_finishes_and_frees(tiny_weights):
    dec = make_engine(tiny_weights)
    p = prompts(1, seed=6, lo=21, hi=22)[0]
    blocks = reserve_blocks(dec, len(p))
    out = adopt_request(dec, "r", p, blocks, 7, SamplingParams(max_tokens=1))
    assert out.finished and out.finish_reason == "length"
    assert dec.allocator.num_free == dec.allocator.num_blocks
