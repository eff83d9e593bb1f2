"""End to end with real processes (``yuebing serve prefill|decode|coupled`` behind ``yuebing
serve conductor``, dummy model in float32) through the ``openai`` client: ``n > 1`` costs one
prefill (the usage's ``yuebing.prefill_tokens`` is the prompt length, not n times it), each
choice samples with its own seed stream (its first token and logprob equal the engine's in this
process within 1e-3), usage counts every choice, streams carry each choice's index, prompt
lists answer in order, and the decode's KV blocks all come back."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from procs import TINY, Cluster

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

PROMPT = list(range(1, 40))  # 39 tokens: two full blocks and a partly filled third
SEED, N, STEPS = 7, 4, 5


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, float, list[int]]]:
    """Each choice's first token, its logprob and the top-2 ids, from the engine here."""
    from yuebing.engine.config import EngineConfig
    from yuebing.engine.engine import LLMEngine
    from yuebing.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", kv_cache_bytes=16 << 20))
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=1, temperature=1.0, seed=SEED,
                                                    n=N, logprobs=2))
    outs = sorted((o for _ in range(5) for o in engine.step() if o.request_id == rid),
                  key=lambda o: o.index)
    return [(o.new_token_ids[0], o.logprobs[0].logprob, o.logprobs[0].top_ids) for o in outs]


@pytest.fixture(scope="module", params=[["prefill", "decode"], ["coupled"]],
                ids=["1P1D", "coupled"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(request.param, instance_args=("--dtype", "float32"))
    yield c
    c.stop()


def _client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _decode(c: Cluster) -> str:
    return next(name for name in c.procs if name.startswith(("decode", "coupled")))


def test_n_choices_cost_one_prefill(cluster: Cluster,
                                    reference: list[tuple[int, float, list[int]]]) -> None:
    c = cluster
    free = c.free_blocks(_decode(c))
    client = _client(c)
    r = client.completions.create(model=TINY, prompt=PROMPT, max_tokens=STEPS, n=N,
                                  temperature=1.0, seed=SEED, logprobs=2,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [ch.index for ch in r.choices] == list(range(N))
    assert r.usage.prompt_tokens == len(PROMPT) and r.usage.completion_tokens == N * STEPS
    # one prefill: the prompt computed once (a fresh cluster: nothing cached)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.model_extra["yuebing"]["prefill_tokens"] == len(PROMPT)
    ids = [ch.model_extra["token_ids"] for ch in r.choices]
    assert all(len(t) == STEPS for t in ids)  # (the dummy model is too peaked for choices to
    # differ; tests/engine/test_choices.py shows they do, each its own seed stream)
    for ch, (tok, lp, top) in zip(r.choices, reference, strict=True):
        assert ch.model_extra["token_ids"][0] == tok
        assert abs(ch.logprobs.token_logprobs[0] - lp) < 1e-3
        assert len(ch.logprobs.top_logprobs[0]) in (2, 3) and len(top) == 2
    stream = list(client.completions.create(
        model=TINY, prompt=PROMPT, max_tokens=STEPS, n=N, temperature=1.0, seed=SEED,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    got: dict[int, list[int]] = {}
    for chunk in stream[:-1]:
        (ch,) = chunk.choices
        got.setdefault(ch.index, []).extend(ch.model_extra["token_ids"])
    assert sorted(got) == list(range(N)) and all(len(v) == STEPS for v in got.values())
    assert [got[j][0] for j in range(N)] == [t for t, _, _ in reference]
    assert stream[-1].usage.completion_tokens == N * STEPS
    usage = stream[-1].usage  # the prompt's full blocks are cached now: the rest computed once
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached == 32 and usage.model_extra["yuebing"]["prefill_tokens"] == len(PROMPT) - 32
    end = time.monotonic() + 20
    while c.free_blocks(_decode(c)) != free:  # every choice's blocks came back
        assert time.monotonic() < end, c.health()
        time.sleep(0.05)


def test_prompt_list_each_routed(cluster: Cluster) -> None:
    client = _client(cluster)
    prompts = [[5, 6, 7], PROMPT, [9] * 20]
    r = client.completions.create(model=TINY, prompt=prompts, max_tokens=3, n=2,
                                  temperature=0, extra_body={"ignore_eos": True,
                                                             "return_token_ids": True})
    assert [ch.index for ch in r.choices] == list(range(6))
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 18
    for i, p in enumerate(prompts):  # greedy: both choices of a prompt agree, and equal
        one = client.completions.create(model=TINY, prompt=p, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True})
        want = one.choices[0].model_extra["token_ids"]
        assert [r.choices[2 * i + j].model_extra["token_ids"] for j in (0, 1)] == [want, want]
    assert len(r.usage.model_extra["yuebing"]["prompts"]) == 3
