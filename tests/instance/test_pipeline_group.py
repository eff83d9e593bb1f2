"""A chunked pipeline parallel prefill group as real processes (dummy model, float32): two stage
instances (``--layers 0:2`` and ``2:4``) prefill a long prompt chunk by chunk, rows passing
through the transfer engine, each streaming its layers' KV to one decode; the tokens equal one
in-process engine's. A stage killed mid-request ends the request with an error on the others
and the decode (nothing hangs); bad layer ranges exit 2 with one line."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from instance_procs import TINY, Result, collect, run_coupled

from yuebing.engine.config import EngineConfig
from yuebing.engine.engine import LLMEngine
from yuebing.engine.sampling import SamplingParams
from yuebing.instance.client import InstanceClient, InstanceError
from yuebing.instance.kvkeys import store_block_keys, store_key
from yuebing.ops.procs import yuebing_argv
from yuebing.protocol.instance import PrefixPlan, Sampling, StagePlan, SubmitTask, TaskMode
from yuebing.store.client.client import StoreClient
from yuebing.store.config import ClientConfig

sys.path.insert(0, str(Path(__file__).parents[1] / "store"))
import store_procs  # noqa: E402

GREEDY = Sampling(max_tokens=8, temperature=0, ignore_eos=True)
LONG = [random.Random(7).randrange(512) for _ in range(700)]
"""Three prefill chunks of 256 on each stage."""


@pytest.fixture(scope="module")
def reference():
    e = LLMEngine(EngineConfig(model=TINY, dtype="float32", threads=1, max_batch_tokens=256))
    return e.generate([LONG], SamplingParams(max_tokens=8, temperature=0,
                                             ignore_eos=True))[0].output_token_ids


async def run_group(stages: list[InstanceClient], segments: list[str], d: InstanceClient,
                    rid: str, ids: list[int], prefix: PrefixPlan | None = None,
                    reuse: int = 0) -> tuple[list[Result], Result]:
    """Reserve on the decode, submit the request to every stage (each loading ``prefix``,
    all reusing ``reuse`` tokens), collect each stage's part, then the decode's tokens."""
    r = await d.reserve(rid, ids, GREEDY, timeout_s=900)
    n = len(stages)
    for i, s in enumerate(stages):
        plan = StagePlan(index=i, count=n, next_segment=segments[i + 1] if i + 1 < n else "",
                         prefix_tokens=reuse)
        await s.submit(SubmitTask(seq=0, request_id=rid, token_ids=ids, sampling=GREEDY,
                                  mode=TaskMode.PREFILL, decode=r.target, stage=plan,
                                  prefix=prefix))
    parts = await asyncio.gather(*[collect(s, rid, Result()) for s in stages])
    out = await asyncio.wait_for(collect(d, rid, Result(tokens=list(parts[-1].tokens))), 60)
    return list(parts), out


async def _clients(*procs):
    clients = []
    for p in procs:
        c = InstanceClient(p.address)
        await c.subscribe()
        clients.append(c)
    return clients


def test_two_stage_group_gives_one_engines_tokens(procs, reference, run):
    s0, s1 = procs("prefill", "--layers", "0:2"), procs("prefill", "--layers", "2:4")
    d = procs("decode")
    assert s0.hello["layers"] == "0:2" and s1.hello["stage_segment"]

    async def go():
        c0, c1, cd = await _clients(s0, s1, d)
        segs = [s0.hello["stage_segment"], s1.hello["stage_segment"]]
        first = await run_group([c0, c1], segs, cd, "g1", LONG)
        again = await run_group([c0, c1], segs, cd, "g2", LONG)  # a second one, same links
        r = await cd.reserve("n2", LONG, GREEDY, timeout_s=60)
        with pytest.raises(InstanceError, match="one choice"):  # refused, nothing started
            await c0.submit(SubmitTask(seq=0, request_id="n2", token_ids=LONG, mode=TaskMode.PREFILL,
                                       sampling=Sampling(max_tokens=2, n=2), decode=r.target,
                                       stage=StagePlan(index=0, count=2, next_segment=segs[1])))
        await cd.cancel("n2")
        for c in (c0, c1, cd):
            await c.close()
        return first, again
    (parts, out), (_, out2) = run(go())
    assert [p.error for p in parts] == ["", ""]
    assert [p.finish for p in parts] == ["handoff", "handoff"]
    b0, b1 = (p.events[-1].breakdown for p in parts)
    assert b0 is not None and b1 is not None
    assert b0.streamed_layers == 2 and b1.streamed_layers == 2 and b0.kv_bytes == b1.kv_bytes
    assert out.error == "" and out.tokens == reference
    assert out2.tokens == reference


def _wait_saved(master_addr: str, fingerprint: str, ranges: list[tuple[int, int]],
                blocks: int, timeout_s: float = 30) -> None:
    keys = store_block_keys(LONG, 256, fingerprint)
    with StoreClient(ClientConfig(master=master_addr), heartbeat=False) as c:
        end = time.monotonic() + timeout_s
        while min(c.prefix_match([store_key(fingerprint, k, r) for k in keys])
                  for r in ranges) < blocks:
            assert time.monotonic() < end, "the stages' blocks never reached the store"
            time.sleep(0.1)


def test_stages_store_their_layers_and_any_instance_reuses_them(procs, reference, run):
    """Each stage saves its layers' objects (``kv/<model fp>/<key>@A:B``); a single instance
    assembles them, and a fresh group loads each stage's own: only the suffix is computed."""
    master = store_procs.master()
    node = store_procs.node(master.info["address"], "64MiB")
    try:
        flags = ("--store-master", master.info["address"])
        s0, s1 = procs("prefill", "--layers", "0:2", *flags), \
            procs("prefill", "--layers", "2:4", *flags)
        d, single = procs("decode"), procs("coupled", *flags)
        t0, t1 = procs("prefill", "--layers", "0:2", *flags), \
            procs("prefill", "--layers", "2:4", *flags)
        model_fp = d.hello["fingerprint"]

        async def go():
            c0, c1, cd, cs, f0, f1 = await _clients(s0, s1, d, single, t0, t1)
            cold = await run_group([c0, c1], [s0.hello["stage_segment"],
                                              s1.hello["stage_segment"]], cd, "cold", LONG)
            _wait_saved(master.info["address"], model_fp, [(0, 2), (2, 4)], 2)
            plan = PrefixPlan(tokens=512, source="store", layer_ranges=["0:2", "2:4"])
            one = await run_coupled(cs, "one", LONG, GREEDY, plan)
            warm = await run_group([f0, f1], [t0.hello["stage_segment"],
                                              t1.hello["stage_segment"]], cd, "warm", LONG,
                                   PrefixPlan(tokens=512, source="store"), reuse=512)
            for c in (c0, c1, cd, cs, f0, f1):
                await c.close()
            return cold, one, warm
        (_, cold), one, (parts, warm) = run(go())
    finally:
        node.kill()
        master.stop()
    assert cold.tokens == reference
    assert one.error == "" and one.cached_tokens == 512 and one.tokens == reference
    assert [p.error for p in parts] == ["", ""] and parts[1].cached_tokens == 512
    assert warm.tokens == reference


def test_a_stage_killed_mid_request_ends_it_everywhere(procs, run):
    s0 = procs("prefill", "--layers", "0:2")
    s1 = procs("prefill", "--layers", "2:4", "--transfer-timeout-s", "3")
    d = procs("decode")

    async def go():
        c0, c1, cd = await _clients(s0, s1, d)
        segs = [s0.hello["stage_segment"], s1.hello["stage_segment"]]
        r = await cd.reserve("k1", LONG, GREEDY, timeout_s=900)
        plan1 = StagePlan(index=1, count=2)
        await c1.submit(SubmitTask(seq=0, request_id="k1", token_ids=LONG, sampling=GREEDY,
                                   mode=TaskMode.PREFILL, decode=r.target, stage=plan1))
        s0.kill()  # the first stage dies before it sent a row
        t = time.monotonic()
        last = await asyncio.wait_for(collect(c1, "k1", Result()), 30)
        dec = await asyncio.wait_for(collect(cd, "k1", Result()), 30)
        for c in (c0, c1, cd):
            await c.close()
        return last, dec, time.monotonic() - t, segs
    last, dec, took, _ = run(go())
    assert "went quiet" in last.error, last
    assert dec.error and took < 20, (dec, took)


@pytest.mark.parametrize(("role", "layers", "says"), [
    ("prefill", "0:9", "reach past the model's 4 layers"),
    ("decode", "0:2", "only a prefill instance runs a layer range"),
])
def test_bad_layer_ranges_exit_2_with_one_line(role, layers, says):
    p = subprocess.run(yuebing_argv(["serve", role, "--model", TINY, "--layers", layers,
                                     "--no-warmup", "--no-startup-profile"]),
                       capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and says in lines[0], p.stderr
