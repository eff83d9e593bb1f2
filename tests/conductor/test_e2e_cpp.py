"""The Conductor over a pipeline group (real processes, dummy model, float32): one single prefill
instance, a group of two stages (``--layers 0:2 / 2:4 --cpp-group g``) and a decode. A long
prompt goes to the group and its greedy tokens equal one engine's; a short one to the single
instance; the stages' store objects serve a single instance (assembled) and a later group
request (each stage its layers); with a stage killed mid-request the request is re-dispatched to the single instance and
the group leaves the view."""

from __future__ import annotations

import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from harness import request
from procs import Cluster

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

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
    events, admin = _free_port(), _free_port()
    feeds = ("--events-address", f"tcp://127.0.0.1:{events}", "--admin-port", str(admin))
    with store_procs.store_cluster("cpp", dram="64MiB", master_args=feeds) as (master, _):
        c = Cluster(["prefill", "prefill --layers 0:2 --cpp-group g",
                     "prefill --layers 2:4 --cpp-group g", "decode"], model=MODEL,
                    instance_args=(*FLAGS, "--store-master", master.info["address"]),
                    conductor_args=("--cpp-threshold-tokens", "300", "--cpp-chunk-tokens",
                                    "256", "--store-events", f"tcp://127.0.0.1:{events}",
                                    "--store-admin", f"http://127.0.0.1:{admin}"))
        yield c
        c.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _complete(c: Cluster, ids: list[int]) -> tuple[list[int], dict]:  # type: ignore[type-arg]
    status, body = request(c.url, "POST", "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout_s=120)
    assert status == 200, body
    ext = dict(body["usage"]["yuebing"], cached_tokens=body["usage"][
        "prompt_tokens_details"]["cached_tokens"])
    return body["choices"][0]["token_ids"], ext


def test_long_prompts_go_to_the_group_short_ones_to_the_single_instance(cluster: Cluster
                                                                         ) -> None:
    h = cluster.health()
    assert h["groups"] == {"g": ["prefill-1", "prefill-2"]} and h["ready"]
    long_tokens, long_ext = _complete(cluster, LONG)
    short_tokens, short_ext = _complete(cluster, SHORT)
    assert long_ext["prefill_instance"] == "g"
    assert short_ext["prefill_instance"] == "prefill-0"
    assert long_tokens == _reference(LONG) and short_tokens == _reference(SHORT)


def test_the_groups_store_objects_serve_later_groups_and_single_instances(cluster: Cluster
                                                                           ) -> None:
    """After the group prefilled LONG, each stage's two store blocks of its layers are in the
    store: LONG again (188 uncached tokens, below the threshold) goes to the single instance,
    which assembles them; a longer prompt on that prefix goes to the group, every stage
    loading its layers' 512 tokens."""
    end = time.monotonic() + 30
    while cluster.health()["kv_index_range_blocks"] != {"0:2": 2, "2:4": 2}:
        assert time.monotonic() < end, cluster.health()["kv_index_range_blocks"]
        time.sleep(0.1)
    tokens, ext = _complete(cluster, LONG)
    assert (ext["prefill_instance"], ext["cached_tokens"]) == ("prefill-0", 512)
    assert tokens == _reference(LONG)
    longer = LONG[:512] + [random.Random(4).randrange(512) for _ in range(400)]
    tokens, ext = _complete(cluster, longer)
    assert (ext["prefill_instance"], ext["cached_tokens"]) == ("g", 512)
    assert tokens == _reference(longer)


def _busy(c: Cluster, name: str) -> bool:
    load = c.health()["load"].get(name, {})
    return bool(load.get("running") or load.get("queued_prefill_tokens"))


def test_a_stage_killed_mid_request_is_survived_and_takes_its_group_out(cluster: Cluster
                                                                        ) -> None:
    """The first stage is killed once its load report shows a long prompt in the group: the
    request is re-dispatched to the single instance (or had finished): 200, the right tokens,
    no hang; the group leaves the view."""
    prompt = [random.Random(9).randrange(512) for _ in range(4000)]
    result: list[tuple[list[int], dict]] = []  # type: ignore[type-arg]
    t = threading.Thread(target=lambda: result.append(_complete(cluster, prompt)))
    t.start()
    end = time.monotonic() + 60
    while not result and not _busy(cluster, "prefill-1"):  # until the first stage has it
        assert time.monotonic() < end, "the request never reached the group"
        time.sleep(0.01)
    cluster.procs["prefill-1"].kill()
    t.join(90)
    assert result, "the request hung"
    tokens, ext = result[0]
    assert ext["prefill_instance"] in ("prefill-0", "g") and tokens == _reference(prompt)
    end = time.monotonic() + 10
    while cluster.health()["groups"]:
        assert time.monotonic() < end
        time.sleep(0.1)
    _, ext = _complete(cluster, LONG)  # long prompts now go to the single instance
    assert ext["prefill_instance"] == "prefill-0"
