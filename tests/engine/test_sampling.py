"""Sampling parameters and the sampler."""

from __future__ import annotations

import math

import pytest
import torch
from engine_factories import make_engine, prompts

from yuebing.core.errors import InputError
from yuebing.engine.sampling import SamplingParams, _filter, make_generator, sample


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": -1}, "max_tokens must be an integer >= 0"),
    ({"temperature": -0.5}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_k": -2}, "top_k must be >= 0"),
    ({"logprobs": 50}, "logprobs must be in 0..20"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
    ({"stop_token_ids": (-1,)}, "stop_token_ids must be token ids"),
])
def test_bad_params_are_rejected(kwargs, match):
    with pytest.raises(InputError, match=match):
        SamplingParams(**kwargs)


def test_top_k_and_top_p_filter_exactly():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    kept = torch.isfinite(_filter(logits, SamplingParams(top_k=2))).tolist()
    assert kept == [True, True, False, False, False]
    kept = torch.isfinite(_filter(logits, SamplingParams(top_p=0.8))).tolist()
    assert kept == [True, True, True, False, False]  # 0.5+0.2 < 0.8 ≤ 0.5+0.2+0.15
    kept = torch.isfinite(_filter(logits, SamplingParams(top_p=0.5))).tolist()
    assert kept == [True, False, False, False, False]


def test_seeded_sampling_is_reproducible_and_logprobs_are_exact():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.9, seed=7, logprobs=2),
              SamplingParams(temperature=0), SamplingParams(top_k=1, logprobs=0)]
    a = sample(logits, params, [make_generator(p) for p in params])
    b = sample(logits, params, [make_generator(p) for p in params])
    assert a.token_ids == b.token_ids
    assert a.token_ids[1] == int(logits[1].argmax()) and a.token_ids[2] == int(logits[2].argmax())
    lp = torch.log_softmax(logits, -1)
    chosen = a.token_ids[0]
    first = a.logprobs[0]
    assert math.isclose(first.logprob, float(lp[0, chosen]), rel_tol=1e-6)
    top = torch.topk(lp[0], 2)
    assert first.top_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), rel=1e-6)
    assert a.logprobs[1] is None
    third = a.logprobs[2]
    assert (third.logprob, third.top_ids) == (pytest.approx(float(lp[2].max())), [])


def test_engine_sampling_seed_independent_of_batch(tiny_weights):
    ps = prompts(4, seed=21)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=123)
    alone = make_engine(tiny_weights).generate([ps[0]], params)[0].output_token_ids
    together = make_engine(tiny_weights).generate(ps, params)[0].output_token_ids
    assert alone == together


def test_stop_token_ids_and_min_tokens(tiny_weights):
    engine = make_engine(tiny_weights)
    p = prompts(1, seed=1)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    full = engine.generate([p], greedy)[0].output_token_ids
    assert len(set(full)) >= 4, full
    stop = full[2]
    out = engine.generate([p], SamplingParams(max_tokens=12, temperature=0,
                                              stop_token_ids=(stop,)))[0]
    assert (out.output_token_ids, out.finish_reason) == (full[:3], "stop")
    # min_tokens masks the stop id out of sampling: the first 4 tokens cannot be it, and the
    # third is the best other token (as vLLM's min_tokens logits processor does)
    out = engine.generate([p], SamplingParams(max_tokens=12, temperature=0, min_tokens=4,
                                              stop_token_ids=(stop,)))[0]
    ids = out.output_token_ids
    assert ids[:2] == full[:2] and stop not in ids[:4] and len(ids) >= 4, ids
    if stop in ids:
        assert ids.index(stop) == len(ids) - 1 and out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length"


def test_min_tokens_masks_eos_unless_ignored(tiny_weights):
    engine = make_engine(tiny_weights)
    p = prompts(1, seed=1)[0]
    full = engine.generate([p], SamplingParams(max_tokens=20, temperature=0,
                                               ignore_eos=True))[0].output_token_ids
    engine.eos_token_ids = frozenset({full[2], full[5]})
    for params in (SamplingParams(max_tokens=20, temperature=0, min_tokens=12),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=5, min_tokens=12)):
        ids = engine.generate([p], params)[0].output_token_ids
        assert len(ids) >= 12 and not set(ids[:12]) & engine.eos_token_ids, ids
    # ignore_eos: EOS is no stop token, so nothing is masked
    out = engine.generate([p], SamplingParams(max_tokens=20, temperature=0, min_tokens=12,
                                              ignore_eos=True))[0]
    assert out.output_token_ids == full


def test_sample_banned_tokens_and_raw_logprobs():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0], [0.0, 5.0, 4.0, 1.0]])
    params = [SamplingParams(temperature=0, logprobs=0),
              SamplingParams(temperature=1.0, seed=3, logprobs=0)]
    gens = [None, torch.Generator().manual_seed(3)]
    res = sample(logits, params, gens, [{1}, {1, 2, 99}])
    assert res.token_ids[0] == 2 and res.token_ids[1] in (0, 3)
    lp = torch.log_softmax(logits, dim=-1)
    assert res.logprobs[0].logprob == pytest.approx(float(lp[0, 2]))  # of the raw logits
    assert torch.equal(logits[0], torch.tensor([0.0, 5.0, 4.0, 1.0]))  # caller's untouched


def test_engine_streams_logprobs_of_the_step_logits(tiny_weights):
    engine = make_engine(tiny_weights)
    captured: list[torch.Tensor] = []
    engine.logits_hook = lambda rids, logits: captured.append(logits[0].clone())
    rid = engine.add_request(prompts(1, seed=2)[0], SamplingParams(max_tokens=4, temperature=0,
                                                                   logprobs=3))
    outs = [o for _ in range(10) for o in engine.step() if o.request_id == rid]
    assert len(outs) == len(captured) == 4 and outs[-1].finish_reason == "length"
    for out, logits in zip(outs, captured, strict=True):
        lp = torch.log_softmax(logits.float(), dim=-1)
        top = torch.topk(lp, 3)
        (entry,) = out.logprobs
        assert entry.top_ids == top.indices.tolist()  # greedy: the chosen token is the top one
        assert out.new_token_ids == [int(top.indices[0])]
        assert entry.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
        assert entry.logprob == pytest.approx(float(top.values[0]), abs=1e-6)
