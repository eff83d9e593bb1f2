"""The Conductor over a pipeline group (real processes, dummy model, float32): one single prefill
instance, a group of two stages (``--layers 0:2 / 2:4 --cpp-group g``) and a decode. A long
prompt goes to the group and its greedy tokens equal one engine's; a short one to the single
instance; with a stage killed the group leaves the view and long prompts go to the single
instance (re-dispatched when the dead stage had them)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from harness import request
from procs import Cluster

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams

MODEL = "dummy:preset=tiny,vocab=512,layers=4,hidden=64,heads=4,kv_heads=2,ffn=128,ctx=4096,tie=0"
LONG = [random.Random(3).randrange(512) for _ in range(700)]
SHORT = LONG[:100]
FLAGS = ("--dtype", "float32", "--max-batch-tokens", "256", "--no-warmup",
         "--kv-cache-bytes", "64MiB")


def _reference(ids: list[int]) -> list[int]:
    e = LLMEngine(EngineConfig(model=MODEL, dtype="float32", threads=1, max_batch_tokens=256))
    return e.generate([ids], SamplingParams(max_tokens=8, temperature=0,
                                            ignore_eos=True))[0].output_token_ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    c = Cluster(["prefill", "prefill --layers 0:2 --cpp-group g",
                 "prefill --layers 2:4 --cpp-group g", "decode"], model=MODEL,
                instance_args=FLAGS,
                conductor_args=("--cpp-threshold-tokens", "300", "--cpp-chunk-tokens", "256"))
    yield c
    c.stop()


def _complete(c: Cluster, ids: list[int]) -> tuple[list[int], dict]:  # type: ignore[type-arg]
    status, body = request(c.url, "POST", "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout_s=120)
    assert status == 200, body
    return body["choices"][0]["token_ids"], body["usage"]["yuebing"]


def test_long_prompts_go_to_the_group_short_ones_to_the_single_instance(cluster: Cluster
                                                                         ) -> None:
    h = cluster.health()
    assert h["groups"] == {"g": ["prefill-1", "prefill-2"]} and h["ready"]
    long_tokens, long_ext = _complete(cluster, LONG)
    short_tokens, short_ext = _complete(cluster, SHORT)
    assert long_ext["prefill_instance"] == "g"
    assert short_ext["prefill_instance"] == "prefill-0"
    again, again_ext = _complete(cluster, LONG)  # the group again: the same tokens
    assert again_ext["prefill_instance"] == "g" and again == long_tokens
    assert long_tokens == _reference(LONG) and short_tokens == _reference(SHORT)


def test_a_dead_stage_takes_its_group_out_of_the_view(cluster: Cluster) -> None:
    cluster.procs["prefill-1"].kill()
    _, ext = _complete(cluster, LONG)  # routed (or re-dispatched) to the single instance
    assert ext["prefill_instance"] == "prefill-0"
    end = time.monotonic() + 10
    while cluster.health()["groups"]:
        assert time.monotonic() < end
        time.sleep(0.1)
