"""The text a client sees through a prefill → decode hand-off (the prefill's first token text,
then the decode's deltas) equals one engine's text, also with stop strings: the decode treats
the first token's text as sent, and the prefill applies the same stop strings."""

from __future__ import annotations

import pytest

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.kv_transfer import adopt_request, reserve_blocks
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.weights import load_weights


@pytest.fixture(scope="module")
def engine():
    try:
        w = load_weights("smollm2")
    except Exception as e:  # noqa: BLE001 - the package is installed by `make install`
        pytest.skip(str(e))
    return LLMEngine(EngineConfig(num_blocks=256, threads=1, dtype="float32"), weights=w)


def _one_engine(e: LLMEngine, ids: list[int], p: SamplingParams) -> str:
    return e.generate([ids], p)[0].text


def _handed_off(e: LLMEngine, ids: list[int], p: SamplingParams) -> str:
    pre = SamplingParams(max_tokens=1, temperature=0, stop=p.stop, ignore_eos=p.ignore_eos)
    rid = e.add_request(ids, pre, request_id="pre", hold_kv=True)
    outs = [o for _ in range(8) for o in e.step() if o.request_id == rid]
    text = outs[-1].text_delta
    held = e.held_sequence(rid)
    assert held is not None
    blocks = reserve_blocks(e, len(ids))
    for layer in range(e.pool.num_layers):
        e.pool.import_layer(layer, blocks, e.pool.export_layer(layer, held.blocks))
    e.release(rid)
    first = adopt_request(e, "dec", ids, blocks, outs[-1].new_token_ids[0], p)
    while not first.finished:
        for o in e.step():
            text += o.text_delta
            if o.finished:
                return text
    return text


@pytest.mark.parametrize("stop", [(), ("\n\n",), ("Paris",), (" is",)])
def test_handoff_text_equals_one_engine(engine, stop):
    ids = engine.encode_prompt([{"role": "user", "content": "What is the capital of France? "
                                 "Answer in two sentences."}], chat=True)
    p = SamplingParams(max_tokens=24, temperature=0, stop=stop)
    assert _handed_off(engine, ids, p) == _one_engine(engine, ids, p)
