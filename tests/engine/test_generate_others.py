"""`generate` and `stream` beside other queued requests (issue 15 item 16): each collects only
its own requests; the others' outputs are not lost but come from the next `step` calls."""

from __future__ import annotations

from engine_factories import make_engine, prompts

from yuebing.engine.sampling import SamplingParams

OTHER = SamplingParams(max_tokens=20, temperature=0)
MINE = SamplingParams(max_tokens=24, temperature=0)


def _drain(engine, rid: str) -> tuple[list[int], list]:
    """Step until idle; the new tokens of ``rid`` in order and its last output."""
    tokens: list[int] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
                last = out
    return tokens, last


def test_generate_collects_only_its_own_and_keeps_the_others(tiny_weights):
    other_p, mine_p = prompts(2, seed=4, lo=6, hi=12)
    ref = make_engine(tiny_weights)
    other_ref = ref.generate([other_p], OTHER)[0].output_token_ids
    mine_ref = ref.generate([mine_p], MINE)[0].output_token_ids
    engine = make_engine(tiny_weights)
    rid = engine.add_request(other_p, OTHER)
    mine = engine.generate([mine_p], MINE)  # the other request (shorter) finishes first
    assert [o.output_token_ids for o in mine] == [mine_ref]
    assert engine.has_unfinished()  # the other request's outputs wait for step()
    tokens, last = _drain(engine, rid)  # every output of the other request, in order
    assert tokens == other_ref and last.finished and last.output_token_ids == other_ref


def test_stream_keeps_the_others_outputs(tiny_weights):
    other_p, mine_p = prompts(2, seed=5, lo=6, hi=12)
    engine = make_engine(tiny_weights)
    other_ref = make_engine(tiny_weights).generate([other_p], OTHER)[0].output_token_ids
    rid = engine.add_request(other_p, OTHER)
    streamed = [o for o in engine.stream(mine_p, SamplingParams(max_tokens=4, temperature=0))]
    assert len(streamed) == 4 and streamed[-1].finished
    assert all(o.request_id != rid for o in streamed)
    tokens, last = _drain(engine, rid)
    assert tokens == other_ref and last.finished


def test_generate_twice_with_deferred_outputs_pending(tiny_weights):
    a, b, c = prompts(3, seed=6, lo=6, hi=12)
    engine = make_engine(tiny_weights)
    rid = engine.add_request(a, SamplingParams(max_tokens=30, temperature=0))
    engine.generate([b], SamplingParams(max_tokens=3, temperature=0))
    engine.generate([c], SamplingParams(max_tokens=3, temperature=0))
    tokens, last = _drain(engine, rid)
    ref = make_engine(tiny_weights).generate([a], SamplingParams(max_tokens=30, temperature=0))
    assert tokens == ref[0].output_token_ids and last.finished
