"""Engines running a layer range (pipeline stages of a chunked pipeline parallel prefill): a
group of stages, each fed the previous one's boundary rows chunk by chunk, gives the same
logits, first token and KV (layer for layer) as one engine with every layer."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from engine_factories import TINY, make_engine, prompts

from yuebing.core.errors import ConfigError, InputError, PrefixMissing
from yuebing.engine.config import EngineConfig, parse_layers
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.engine.weights import LoadedWeights, dummy_weights, parse_dummy_spec

FOUR = TINY.replace("layers=2", "layers=4")
FIRST = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def four() -> LoadedWeights:
    return dummy_weights(parse_dummy_spec(FOUR), seed=5)


def _run_group(stages: list[LLMEngine], prompt: list[int], rid: str = "r",
               prefix_tokens: int | None = None) -> tuple[list[int], torch.Tensor]:
    """Pipeline ``prompt`` through ``stages`` step by step (each stage steps once per round,
    fed what the previous produced): (the last stage's first token, its logits)."""
    logits: list[torch.Tensor] = []
    stages[-1].logits_hook = lambda rids, lg: logits.append(lg.clone())
    for e in stages:
        e.add_request(prompt, FIRST, request_id=rid, hold_kv=True,
                      prefix_tokens=prefix_tokens)
    token: list[int] = []
    for _ in range(10 * len(prompt)):
        for k, e in enumerate(stages):
            for out in e.step():
                if out.boundary is not None:
                    start, res, x = out.boundary
                    stages[k + 1].feed(rid, start, res, x)
                else:
                    token = out.new_token_ids
        if token:
            return token, logits[-1]
    raise AssertionError("the group did not finish")


def _kv(e: LLMEngine, rid: str, local_layer: int) -> torch.Tensor:
    seq = e.held_sequence(rid)
    assert seq is not None
    return e.pool.export_layer(local_layer, seq.blocks)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cuts", [(2,), (1, 3)])
def test_a_group_computes_the_same_bits_as_one_engine(four: LoadedWeights, dtype: str,
                                                      cuts: tuple[int, ...]) -> None:
    kw = dict(model=FOUR, dtype=dtype, max_batch_tokens=16)  # 16-token chunks
    full = make_engine(four, **kw)
    edges = (0, *cuts, 4)
    stages = [make_engine(four, layers=f"{a}:{b}", **kw) for a, b in pairwise(edges)]
    prompt = prompts(1, seed=11, lo=50, hi=51)[0]
    want: list[torch.Tensor] = []
    full.logits_hook = lambda rids, lg: want.append(lg.clone())
    full.add_request(prompt, FIRST, request_id="r", hold_kv=True)
    (ref,) = [o for _ in range(10) for o in full.step()]
    token, logits = _run_group(stages, prompt)
    assert token == ref.new_token_ids
    assert torch.equal(logits, want[-1])
    for (a, _), e in zip(pairwise(edges), stages, strict=True):
        for i in range(e.layers[1] - e.layers[0]):
            assert torch.equal(_kv(e, "r", i), _kv(full, "r", a + i)), (e.layers, i)
    assert stages[0].model.lm_head is None and stages[-1].model.embed is None
    assert len(stages[0].pool.layers) == edges[1]
    assert len({full.fingerprint, *(e.fingerprint for e in stages)}) == len(stages) + 1


def test_stages_reuse_a_common_cached_prefix(four: LoadedWeights) -> None:
    kw = dict(model=FOUR, max_batch_tokens=16)
    full = make_engine(four, **kw)
    stages = [make_engine(four, layers="0:2", **kw), make_engine(four, layers="2:4", **kw)]
    shared = prompts(1, seed=3, lo=40, hi=41)[0]
    first, second = shared + [1, 2, 3], shared + [7, 8, 9, 10, 11]
    _run_group(stages, first, "a")
    for e in stages:
        assert e.release("a")
    want: list[torch.Tensor] = []
    full.logits_hook = lambda rids, lg: want.append(lg.clone())
    full.generate([second], FIRST)
    token, logits = _run_group(stages, second, "b", prefix_tokens=40)
    assert torch.equal(logits, want[-1])
    for e in stages:
        seq = e.held_sequence("b")
        assert seq is not None and seq.num_cached_tokens == 40
    third = shared + list(range(20, 29))  # block 10 differs from both prompts'
    with pytest.raises(PrefixMissing, match="hold 40 tokens"):
        stages[1].add_request(third, FIRST, request_id="c", prefix_tokens=48)


def test_stage_input_in_wrong_order_or_shape_is_refused(four: LoadedWeights) -> None:
    first, second = (make_engine(four, model=FOUR, layers="0:2", max_batch_tokens=16),
                     make_engine(four, model=FOUR, layers="2:4"))
    p = prompts(1, seed=2, lo=20, hi=21)[0]
    first.add_request(p, FIRST, request_id="r")
    second.add_request(p, FIRST, request_id="r")
    (out,) = first.step()
    start, res, x = out.boundary  # type: ignore[misc]
    with pytest.raises(InputError, match="first stage"):
        first.feed("r", start, res, x)
    with pytest.raises(InputError, match="not waiting"):
        second.feed("nope", start, res, x)
    with pytest.raises(InputError, match="rows"):
        second.feed("r", start, res[:, :3], x[:, :3])
    with pytest.raises(InputError, match="hold only 0 tokens"):
        second.feed("r", 4, res[4:], x[4:])  # nothing cached here: must start at 0
    second.feed("r", start, res[:5], x[:5])
    with pytest.raises(InputError, match="does not follow"):
        second.feed("r", 6, res[6:], x[6:])  # a gap after position 5
    second.feed("r", 5, res[5:], x[5:])
    assert second.step() == []  # 16 of 20 positions through, no token yet
    (out,) = first.step()
    assert out.finished and out.boundary is not None and out.boundary[0] == 16
    second.feed("r", *out.boundary)
    (last,) = second.step()
    assert last.finished and len(last.new_token_ids) == 1


def test_layer_ranges_are_checked() -> None:
    assert parse_layers("", 30) == (0, 30) and parse_layers("3:7", 30) == (3, 7)
    for bad, says in [("7:3", "empty"), ("0:31", "past the model's 30"), ("a:b", "A:B"),
                      ("5", "A:B"), ("-1:3", "A:B")]:
        with pytest.raises(ConfigError, match=says):
            parse_layers(bad, 30)
    with pytest.raises(ConfigError, match="empty"):
        EngineConfig(layers="4:4")


def test_a_range_past_the_model_fails_at_start(four: LoadedWeights) -> None:
    with pytest.raises(ConfigError, match="past the model's 4 layers"):
        make_engine(four, model=FOUR, layers="2:6")
    full = make_engine(four, model=FOUR)
    with pytest.raises(InputError, match="pipeline stages"):
        full.add_request([1, 2, 3], FIRST, prefix_tokens=0)
